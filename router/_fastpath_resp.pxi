# Included by router/_fastpath.pyx (the one compiled module).
#
# RESP for the shared server's round trips (router/store/shared.py's Wire). Rules:
# 1. `resp_commands(commands)` writes a round trip's commands as one buffer: each command (a
#    tuple of arguments) an array of bulk strings. An argument is bytes (as is), str (UTF-8), or
#    int or float (its `str`); anything else is a TypeError, raised before anything is written.
# 2. The output is byte for byte what hiredis' packer (`hiredis.pack_command`) writes for each
#    command, joined (tests/test_fastpath_resp.py checks it over random commands); hiredis formats
#    each length with sprintf, ~720 instructions apiece, two to four a command argument: here
#    the digits are written in place, after one pass that sizes the buffer.

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_AsUTF8String


cdef inline Py_ssize_t _decimal_size(Py_ssize_t n):
    cdef Py_ssize_t size = 1
    while n >= 10:
        n //= 10
        size += 1
    return size


cdef inline char* _length_line(char* at, char mark, Py_ssize_t n):
    """`mark`, `n` in decimal, CRLF; returns where the next byte goes."""
    cdef Py_ssize_t size = _decimal_size(n)
    cdef Py_ssize_t i = size
    at[0] = mark
    while i > 0:
        at[i] = <char>(48 + n % 10)
        n //= 10
        i -= 1
    at[size + 1] = 13
    at[size + 2] = 10
    return at + size + 3


def resp_commands(commands):
    cdef list parts = []  # per command: its argument count, then each argument as bytes
    cdef Py_ssize_t total = 0
    cdef Py_ssize_t size
    cdef object arg
    cdef object kind
    cdef bytes data
    for command in commands:
        size = len(command)
        parts.append(size)
        total += _decimal_size(size) + 3
        for arg in command:
            kind = type(arg)
            if kind is bytes:
                data = <bytes>arg
            elif kind is str:
                data = PyUnicode_AsUTF8String(arg)
            elif kind is int or kind is float:
                data = PyUnicode_AsUTF8String(str(arg))
            else:
                raise TypeError(f"a command's arguments are bytes, str, int or float, not {kind.__name__}")
            parts.append(data)
            size = PyBytes_GET_SIZE(data)
            total += _decimal_size(size) + size + 5
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef char* at = PyBytes_AS_STRING(out)
    for part in parts:
        if type(part) is int:
            at = _length_line(at, 42, <Py_ssize_t>part)  # '*'
        else:
            size = PyBytes_GET_SIZE(<bytes>part)
            at = _length_line(at, 36, size)  # '$'
            memcpy(at, PyBytes_AS_STRING(<bytes>part), size)
            at[size] = 13
            at[size + 1] = 10
            at += size + 2
    return out
