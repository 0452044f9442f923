# Included by router/_fastpath.pyx (the one compiled module).
#
# RESP for the shared server's round trips (router/fleetwide/wire.py's Wire). Rules:
# 1. `resp_commands(commands)` writes a round trip's commands (a list) as one buffer: each
#    command (a tuple of arguments) an array of bulk strings. An argument is bytes (as is), str
#    (UTF-8), or int or float (its `str`); anything else is a TypeError, raised before anything
#    is written.
# 2. The output is byte for byte what hiredis' packer (`hiredis.pack_command`) writes for each
#    command, joined (tests/test_fastpath_resp.py checks it over random commands); hiredis formats
#    each length with sprintf, ~720 instructions apiece, two to four a command argument: here one
#    pass sizes the buffer and a second writes it, an int's digits and every length in place.

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_AsUTF8String


cdef extern from "Python.h":
    long long PyLong_AsLongLongAndOverflow(object value, int* overflow) except? -1


cdef inline Py_ssize_t _decimal_size(unsigned long long n):
    cdef Py_ssize_t size = 1
    while n >= 10:
        n //= 10
        size += 1
    return size


cdef inline char* _decimal(char* at, unsigned long long n, Py_ssize_t size):
    """`n` in `size` decimal digits; returns where the next byte goes."""
    cdef Py_ssize_t i = size - 1
    while i >= 0:
        at[i] = <char>(48 + n % 10)
        n //= 10
        i -= 1
    return at + size


cdef inline char* _length_line(char* at, char mark, Py_ssize_t n):
    """`mark`, `n` in decimal, CRLF; returns where the next byte goes."""
    at[0] = mark
    at = _decimal(at + 1, n, _decimal_size(n))
    at[0] = 13
    at[1] = 10
    return at + 2


cdef inline bint _small_int(object arg, long long* value):
    """An int that fits a C long long (its digits are written in place); else False."""
    cdef int overflow = 0
    value[0] = PyLong_AsLongLongAndOverflow(arg, &overflow)
    return overflow == 0 and value[0] > -9223372036854775807


def resp_commands(list commands):
    cdef list encoded = []  # the str and float arguments (and the largest ints) as bytes, in order
    cdef Py_ssize_t total = 0
    cdef Py_ssize_t size
    cdef Py_ssize_t taken = 0
    cdef long long value
    cdef unsigned long long magnitude
    cdef object arg
    cdef object kind
    cdef bytes data
    for command in commands:  # the size of the buffer
        total += _decimal_size(len(command)) + 3
        for arg in command:
            kind = type(arg)
            if kind is bytes:
                size = PyBytes_GET_SIZE(<bytes>arg)
            elif kind is int and _small_int(arg, &value):
                size = _decimal_size(-value if value < 0 else value) + (value < 0)
            elif kind is str or kind is int or kind is float:
                data = PyUnicode_AsUTF8String(arg if kind is str else str(arg))
                encoded.append(data)
                size = PyBytes_GET_SIZE(data)
            else:
                raise TypeError(f"a command's arguments are bytes, str, int or float, not {kind.__name__}")
            total += _decimal_size(size) + size + 5
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef char* at = PyBytes_AS_STRING(out)
    for command in commands:  # the same walk, writing
        at = _length_line(at, 42, len(command))  # '*'
        for arg in command:
            kind = type(arg)
            if kind is bytes:
                data = <bytes>arg
            elif kind is int and _small_int(arg, &value):
                magnitude = -value if value < 0 else value
                size = _decimal_size(magnitude)
                at = _length_line(at, 36, size + (value < 0))  # '$'
                if value < 0:
                    at[0] = 45  # '-'
                    at += 1
                at = _decimal(at, magnitude, size)
                at[0] = 13
                at[1] = 10
                at += 2
                continue
            else:
                data = <bytes>encoded[taken]
                taken += 1
            size = PyBytes_GET_SIZE(data)
            at = _length_line(at, 36, size)  # '$'
            memcpy(at, PyBytes_AS_STRING(data), size)
            at[size] = 13
            at[size + 1] = 10
            at += size + 2
    return out
