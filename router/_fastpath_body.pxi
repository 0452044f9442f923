# Included by router/_fastpath.pyx (the one compiled module).
#
# `json_members(body, names)`: checks that a request body is one JSON object (RFC 8259, UTF-8,
# nesting at most 1,024) and finds the byte spans of the top-level members `names`, keys compared
# as JSON decodes them, without building any object. The plain model in tests/test_body.py is
# the stdlib parser.
# `form_field(body, delimiter, name)`: the byte span of text form field `name` in a
# multipart/form-data body, and how many parts name it as a box's parser may read their heads,
# found by scanning part heads only. Its plain model (the Python scan it replaced) is in
# tests/test_body.py.

# A body scan releases the GIL only from this size up (a large body is scanned on a worker
# thread while the loop runs). A small one keeps it: the scan takes ~0.3 µs, and a release lets
# a waiting thread (Granian's, the route-log writer) take the GIL, which the loop then waits to
# get back: json_fields showed as 6 % of the loop's samples under load with every scan released.
DEF RELEASE_GIL_BYTES = 64 * 1024


# --- json_members: the top-level members routing reads, found without building the body ------

DEF MAX_DEPTH = 1024      # nesting orjson also refuses past
DEF MAX_NAMES = 16  # a facade's routing members, the answer bounds, and affinity's (messages, input, prompt and its keys)
DEF MAX_NAME_BYTES = 32

# Scan verdicts (0 = a JSON object); the message for each is in _SCAN_ERRORS.
DEF BAD_SYNTAX = 1
DEF BAD_STRING = 2
DEF BAD_UTF8 = 3
DEF TOO_DEEP = 4
DEF NOT_OBJECT = 5
DEF TRUNCATED = 6

_SCAN_ERRORS = {
    BAD_SYNTAX: "is not valid JSON",
    BAD_STRING: "has a bad string (a control character or a bad escape)",
    BAD_UTF8: "is not valid UTF-8",
    TOO_DEEP: "is nested too deeply",
    NOT_OBJECT: "must be a JSON object",
    TRUNCATED: "ends before the JSON does",
}

cdef struct Names:
    int count
    int length[MAX_NAMES]
    unsigned char text[MAX_NAMES][MAX_NAME_BYTES]
    # what the scan found, per name
    Py_ssize_t seen[MAX_NAMES]
    Py_ssize_t start[MAX_NAMES]
    Py_ssize_t end[MAX_NAMES]


cdef inline bint _cont(unsigned char c) noexcept nogil:
    return 0x80 <= c <= 0xBF


cdef inline int _hex(unsigned char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef Py_ssize_t _string_end(const unsigned char* p, Py_ssize_t i, Py_ssize_t n, int* err) noexcept nogil:
    """`p[i]` is the opening quote: the index after the closing one, or -1 with `err` set.
    Checks escapes, control characters and UTF-8 (RFC 8259 §7, RFC 3629 §4)."""
    cdef unsigned char c, c1
    i += 1
    while i < n:
        c = p[i]
        if c == 34:  # "
            return i + 1
        if c == 92:  # backslash
            if i + 1 >= n:
                err[0] = TRUNCATED
                return -1
            c = p[i + 1]
            if c == 117:  # u
                if i + 5 >= n:
                    err[0] = TRUNCATED
                    return -1
                if _hex(p[i + 2]) < 0 or _hex(p[i + 3]) < 0 or _hex(p[i + 4]) < 0 or _hex(p[i + 5]) < 0:
                    err[0] = BAD_STRING
                    return -1
                i += 6
            elif c == 34 or c == 92 or c == 47 or c == 98 or c == 102 or c == 110 or c == 114 or c == 116:
                i += 2
            else:
                err[0] = BAD_STRING
                return -1
        elif c < 0x20:
            err[0] = BAD_STRING
            return -1
        elif c < 0x80:
            i += 1
        else:
            if 0xC2 <= c <= 0xDF:
                if i + 1 >= n or not _cont(p[i + 1]):
                    err[0] = BAD_UTF8
                    return -1
                i += 2
            elif 0xE0 <= c <= 0xEF:
                if i + 2 >= n or not _cont(p[i + 2]):
                    err[0] = BAD_UTF8
                    return -1
                c1 = p[i + 1]
                if not ((c == 0xE0 and 0xA0 <= c1 <= 0xBF) or (c == 0xED and 0x80 <= c1 <= 0x9F)
                        or (c != 0xE0 and c != 0xED and _cont(c1))):
                    err[0] = BAD_UTF8
                    return -1
                i += 3
            elif 0xF0 <= c <= 0xF4:
                if i + 3 >= n or not _cont(p[i + 2]) or not _cont(p[i + 3]):
                    err[0] = BAD_UTF8
                    return -1
                c1 = p[i + 1]
                if not ((c == 0xF0 and 0x90 <= c1 <= 0xBF) or (c == 0xF4 and 0x80 <= c1 <= 0x8F)
                        or (0xF1 <= c <= 0xF3 and _cont(c1))):
                    err[0] = BAD_UTF8
                    return -1
                i += 4
            else:
                err[0] = BAD_UTF8
                return -1
    err[0] = TRUNCATED
    return -1


cdef int _which_name(const unsigned char* p, Py_ssize_t start, Py_ssize_t end, Names* names) noexcept nogil:
    """The index of the name the (valid) key string p[start:end] decodes to, or -1. Names are
    ASCII, so a key that decodes to anything else, or to more than MAX_NAME_BYTES, is none."""
    cdef unsigned char buf[MAX_NAME_BYTES]
    cdef int size = 0, k, code
    cdef Py_ssize_t i = start + 1
    cdef unsigned char c
    end -= 1  # the closing quote
    while i < end:
        if size == MAX_NAME_BYTES:
            return -1
        c = p[i]
        if c == 92:
            c = p[i + 1]
            if c == 117:
                code = (_hex(p[i + 2]) << 12) | (_hex(p[i + 3]) << 8) | (_hex(p[i + 4]) << 4) | _hex(p[i + 5])
                if code >= 0x80:
                    return -1
                c = <unsigned char> code
                i += 6
            else:
                if c == 98:
                    c = 8
                elif c == 102:
                    c = 12
                elif c == 110:
                    c = 10
                elif c == 114:
                    c = 13
                elif c == 116:
                    c = 9
                i += 2  # ", \ and / stand for themselves
        elif c >= 0x80:
            return -1
        else:
            i += 1
        buf[size] = c
        size += 1
    for k in range(names.count):
        if names.length[k] == size and memcmp(buf, names.text[k], size) == 0:
            return k
    return -1


cdef inline Py_ssize_t _skip_ws(const unsigned char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and (p[i] == 32 or p[i] == 10 or p[i] == 13 or p[i] == 9):
        i += 1
    return i


cdef Py_ssize_t _number_end(const unsigned char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The index after the number at `i` (RFC 8259 §6), or -1."""
    if p[i] == 45:  # -
        i += 1
    if i < n and p[i] == 48:
        i += 1
    elif i < n and 49 <= p[i] <= 57:
        while i < n and 48 <= p[i] <= 57:
            i += 1
    else:
        return -1
    if i < n and p[i] == 46:  # .
        i += 1
        if i >= n or not 48 <= p[i] <= 57:
            return -1
        while i < n and 48 <= p[i] <= 57:
            i += 1
    if i < n and (p[i] == 101 or p[i] == 69):  # e E
        i += 1
        if i < n and (p[i] == 43 or p[i] == 45):
            i += 1
        if i >= n or not 48 <= p[i] <= 57:
            return -1
        while i < n and 48 <= p[i] <= 57:
            i += 1
    return i


DEF S_VALUE = 0      # a value comes next
DEF S_AFTER = 1      # a value ended: `,` or the container's end
DEF S_KEY = 2        # a key comes next (after `,` in an object)
DEF S_OBJ_FIRST = 3  # just after `{`: a key or `}`
DEF S_ARR_FIRST = 4  # just after `[`: a value or `]`


cdef int _scan(const unsigned char* p, Py_ssize_t n, Names* names, Py_ssize_t* where) noexcept nogil:
    """Checks that p[:n] is one JSON object (RFC 8259, nesting at most MAX_DEPTH) and records,
    for each name, how often it is a top-level key and the span of its first value. Returns 0,
    or an error verdict with `where` set to the byte it was found at."""
    cdef unsigned char stack[MAX_DEPTH]
    cdef int depth = 0, state, err = 0, member = -1
    cdef Py_ssize_t i = _skip_ws(p, 0, n), j
    cdef unsigned char c
    if i >= n:
        where[0] = i
        return TRUNCATED
    if p[i] != 123:  # {
        where[0] = i
        return NOT_OBJECT
    stack[0] = 123
    depth = 1
    i += 1
    state = S_OBJ_FIRST
    while True:
        i = _skip_ws(p, i, n)
        where[0] = i
        if i >= n:
            return TRUNCATED
        c = p[i]
        if state == S_OBJ_FIRST or state == S_KEY:
            if c == 125 and state == S_OBJ_FIRST:  # }
                state = S_AFTER
                continue
            if c != 34:
                return BAD_SYNTAX
            j = _string_end(p, i, n, &err)
            if j < 0:
                return err
            if depth == 1:
                member = _which_name(p, i, j, names)
            i = _skip_ws(p, j, n)
            where[0] = i
            if i >= n:
                return TRUNCATED
            if p[i] != 58:  # :
                return BAD_SYNTAX
            i = _skip_ws(p, i + 1, n)
            if depth == 1 and member >= 0:
                names.seen[member] += 1
                if names.seen[member] == 1:
                    names.start[member] = i
            state = S_VALUE
        elif state == S_ARR_FIRST and c == 93:  # ]
            state = S_AFTER
        elif state == S_VALUE or state == S_ARR_FIRST:
            if c == 123 or c == 91:  # { [
                if depth == MAX_DEPTH:
                    return TOO_DEEP
                stack[depth] = c
                depth += 1
                i += 1
                state = S_OBJ_FIRST if c == 123 else S_ARR_FIRST
                continue
            if c == 34:
                j = _string_end(p, i, n, &err)
                if j < 0:
                    return err
            elif c == 45 or 48 <= c <= 57:
                j = _number_end(p, i, n)
                if j < 0:
                    return BAD_SYNTAX
            elif c == 116 and i + 4 <= n and memcmp(p + i, b"true", 4) == 0:
                j = i + 4
            elif c == 102 and i + 5 <= n and memcmp(p + i, b"false", 5) == 0:
                j = i + 5
            elif c == 110 and i + 4 <= n and memcmp(p + i, b"null", 4) == 0:
                j = i + 4
            else:
                return BAD_SYNTAX
            if depth == 1 and member >= 0 and names.seen[member] == 1:
                names.end[member] = j
            i = j
            state = S_AFTER
        else:  # S_AFTER
            if c == 44:  # ,
                i += 1
                state = S_KEY if stack[depth - 1] == 123 else S_VALUE
                if depth == 1:
                    member = -1
            elif (c == 125 and stack[depth - 1] == 123) or (c == 93 and stack[depth - 1] == 91):
                depth -= 1
                i += 1
                if depth == 0:
                    i = _skip_ws(p, i, n)
                    where[0] = i
                    return 0 if i == n else BAD_SYNTAX
                if depth == 1 and member >= 0 and names.seen[member] == 1:
                    names.end[member] = i
            else:
                return BAD_SYNTAX


def json_members(bytes body, tuple names):
    """Checks that `body` is one JSON object and finds its top-level `names` (ASCII bytes, at
    most 8, each at most 32 bytes), keys compared as JSON decodes them (escapes included).

    Returns a tuple with, per name, None (absent) or (start, end, count): the byte span of its
    first value and how many times it is a key. Raises ValueError (message: what is wrong and
    at which byte, never the content). The scan of a large body holds no GIL
    (RELEASE_GIL_BYTES): it may be scanned on another thread while the event loop runs.
    """
    cdef Names found
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(body)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body), where = 0
    cdef int verdict, k
    if len(names) > MAX_NAMES:
        raise ValueError("too many names")
    found.count = len(names)
    for k, name in enumerate(names):
        if len(name) > MAX_NAME_BYTES:
            raise ValueError("name too long")
        found.length[k] = len(name)
        memcpy(found.text[k], PyBytes_AS_STRING(name), len(name))
        found.seen[k] = 0
        found.start[k] = 0
        found.end[k] = 0
    if n >= RELEASE_GIL_BYTES:
        with nogil:
            verdict = _scan(p, n, &found, &where)
    else:
        verdict = _scan(p, n, &found, &where)
    if verdict:
        raise ValueError(f"{_SCAN_ERRORS[verdict]} (at byte {where})")
    # A C loop into a list, not a generator: this runs on every JSON call.
    cdef list spans = [None] * found.count
    for k in range(found.count):
        if found.seen[k]:
            spans[k] = (found.start[k], found.end[k], found.seen[k])
    return tuple(spans)


# --- form_field: one text field of a multipart/form-data body -----------------------------------

DEF DISPOSITION_LEN = 20  # len("content-disposition:")


cdef inline Py_ssize_t _find(const unsigned char* p, Py_ssize_t n, Py_ssize_t start,
                             const unsigned char* needle, Py_ssize_t m) noexcept nogil:
    """bytes.find: the first index >= start of `needle` in p[:n], or -1."""
    if start > n:
        return -1
    cdef const unsigned char* hit = <const unsigned char*> memmem(p + start, n - start, needle, m)
    return -1 if hit == NULL else hit - p


cdef inline bint _word(unsigned char c) noexcept nogil:
    return (48 <= c <= 57) or (65 <= c <= 90) or (97 <= c <= 122) or c == 95


cdef inline unsigned char _lower(unsigned char c) noexcept nogil:
    return c + 32 if 65 <= c <= 90 else c


cdef bint _line_names(const unsigned char* line, Py_ssize_t n, const unsigned char* name, Py_ssize_t m) noexcept nogil:
    """Whether a part-head line is a `Content-Disposition:` (any case) whose first `name="..."`
    (any case, at a word start) is `name`, with no `filename=` in the line."""
    cdef const unsigned char* disposition = b"content-disposition:"
    cdef const unsigned char* key = b'name="'
    cdef Py_ssize_t k, j, value
    if n < DISPOSITION_LEN:
        return False
    for k in range(DISPOSITION_LEN):
        if _lower(line[k]) != disposition[k]:
            return False
    for k in range(n - 5):
        if k > 0 and _word(line[k - 1]):
            continue
        for j in range(6):
            if _lower(line[k + j]) != key[j]:
                break
        else:
            value = k + 6
            j = value
            while j < n and line[j] != 34:
                j += 1
            if j == n:  # no closing quote: no later `name="` can have one either
                return False
            return (j - value == m and memcmp(line + value, name, m) == 0
                    and memmem(line, n, b"filename=", 9) == NULL)
    return False


cdef inline bint _name_char(unsigned char c) noexcept nogil:
    """A byte of a bare (unquoted) parameter value: not a space, a tab, `;` or a quote."""
    return c != 32 and c != 9 and c != 59 and c != 34


cdef bint _line_mentions(const unsigned char* line, Py_ssize_t n, const unsigned char* name, Py_ssize_t m) noexcept nogil:
    """Whether a part-head line is a `Content-Disposition:` (any case) with any `name` parameter
    (any case, at a word start as in `_line_names`) whose value, quoted or bare, spaces around
    its `=`, is `name`, or with an RFC 2231 `name*` one (its value is not compared: it counts).
    A box's parser keeps one of several `name`s, maybe the last: each counts, file part or not."""
    cdef const unsigned char* disposition = b"content-disposition:"
    cdef const unsigned char* key = b"name"
    cdef Py_ssize_t k, j, value
    if n < DISPOSITION_LEN:
        return False
    for k in range(DISPOSITION_LEN):
        if _lower(line[k]) != disposition[k]:
            return False
    for k in range(DISPOSITION_LEN, n - 3):
        if _word(line[k - 1]):
            continue
        for j in range(4):
            if _lower(line[k + j]) != key[j]:
                break
        else:
            j = k + 4
            if j < n and line[j] == 42:  # `name*=`
                return True
            while j < n and (line[j] == 32 or line[j] == 9):
                j += 1
            if j == n or line[j] != 61:  # not `=`
                continue
            j += 1
            while j < n and (line[j] == 32 or line[j] == 9):
                j += 1
            if j < n and line[j] == 34:
                value = j + 1
                j = value
                while j < n and line[j] != 34:
                    j += 1
            else:
                value = j
                while j < n and _name_char(line[j]):
                    j += 1
            if j - value == m and memcmp(line + value, name, m) == 0:
                return True
    return False


cdef int _form_field(const unsigned char* p, Py_ssize_t n, const unsigned char* delimiter, Py_ssize_t dl,
                     const unsigned char* name, Py_ssize_t m, Py_ssize_t* span) noexcept nogil:
    """How many whole parts name `name` (`_line_mentions`), 2 at most (the scan stops there);
    `span` the first text part's value (`_line_names`), else span[0] -1."""
    cdef Py_ssize_t start = _find(p, n, 0, delimiter + 2, dl - 2)  # the first has no CRLF before it
    cdef Py_ssize_t head_start, head_end, next_start, line, line_end
    cdef int count = 0
    span[0] = -1
    while start != -1:
        head_start = start + dl - 2
        if head_start + 2 <= n and p[head_start] == 45 and p[head_start + 1] == 45:
            return count  # the closing delimiter
        head_end = _find(p, n, head_start, b"\r\n\r\n", 4)
        if head_end == -1:
            return count
        next_start = _find(p, n, head_end + 4, delimiter, dl)
        if next_start == -1:
            return count
        line = head_start
        while line <= head_end:
            line_end = _find(p, head_end, line, b"\r\n", 2)
            if line_end == -1:
                line_end = head_end
            if _line_mentions(p + line, line_end - line, name, m):
                count += 1
                if count == 2:
                    return count
            if span[0] == -1 and _line_names(p + line, line_end - line, name, m):
                span[0] = head_end + 4
                span[1] = next_start
            line = line_end + 2
        start = next_start + 2
    return count


def form_field(bytes body, bytes delimiter, bytes name):
    """(span, count): the byte span (start, end) of text form field `name` (not a file part) in
    multipart body `body` whose parts are separated by `delimiter` (`--` + the boundary), None
    when absent, and how many parts name `name` as a box may read their heads (0, 1, or 2 for
    more than one); parts the body ends before are not read. A large body is scanned without
    the GIL.
    """
    cdef bytes separator = b"\r\n" + delimiter
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(body)
    cdef const unsigned char* d = <const unsigned char*> PyBytes_AS_STRING(separator)
    cdef const unsigned char* f = <const unsigned char*> PyBytes_AS_STRING(name)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body), dl = PyBytes_GET_SIZE(separator), m = PyBytes_GET_SIZE(name)
    cdef Py_ssize_t span[2]
    cdef int count
    if n >= RELEASE_GIL_BYTES:
        with nogil:
            count = _form_field(p, n, d, dl, f, m, span)
    else:
        count = _form_field(p, n, d, dl, f, m, span)
    return ((span[0], span[1]) if span[0] != -1 else None), count


# --- last_counts: a usage report's counts, read off an answer's end (facades/usage.py rule 1) ---

cdef inline bint _regex_space(unsigned char c) noexcept nogil:
    """`\s` of a bytes regular expression: space, \t, \n, \v, \f, \r."""
    return c == 32 or 9 <= c <= 13


cdef bint _count_at(const unsigned char* p, Py_ssize_t n, Py_ssize_t i, long long* count) noexcept nogil:
    """Whether p[i:] starts with `\s*:\s*` and 1 to 15 digits (the rest of a JSON member whose
    quoted name ends at i); the digits' value into `count`."""
    cdef int digits = 0
    cdef long long value = 0
    while i < n and _regex_space(p[i]):
        i += 1
    if i >= n or p[i] != 58:  # ':'
        return False
    i += 1
    while i < n and _regex_space(p[i]):
        i += 1
    while i < n and digits < 15 and 48 <= p[i] <= 57:
        value = value * 10 + (p[i] - 48)
        digits += 1
        i += 1
    if digits == 0:
        return False
    count[0] = value
    return True


from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

# last_counts' keys at most, all counts together (a bit each in a mask), and counts at most: a few
# names per count in facades/usage.py.
DEF MAX_COUNT_KEYS = 16


def last_counts(tail, tuple counts, Py_ssize_t floor):
    """For each of `counts` (a tuple of keys each: quoted JSON names, `b'"prompt_tokens"'`), the
    count of the last occurrence in `tail` (bytes, from `floor` on) of any of its keys followed
    by `:` and a number, or None; a tuple in `counts`' order.

    One pass from the end for every key (not one per key or per count), which ends once each
    count is found: a report at the end costs a look at the bytes after it. Where all keys share
    their first byte (a quote) only those bytes are looked at, and there only the keys whose
    second byte follows (a table by second byte). A key's occurrence without a number after it
    sends that key's search below it, to occurrences that end by its start (as bytes.rfind over
    a shrinking range does: tests/test_usage.py's reference)."""
    if not isinstance(tail, bytes):
        raise TypeError("tail must be bytes")
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(tail)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(tail), after = max(floor, 0), i, j, k, m, count_keys = 0
    cdef const unsigned char* names[MAX_COUNT_KEYS]
    cdef Py_ssize_t sizes[MAX_COUNT_KEYS]
    cdef Py_ssize_t limits[MAX_COUNT_KEYS]  # a key's occurrences must end by here
    cdef Py_ssize_t of_count[MAX_COUNT_KEYS]  # the count a key is one of
    cdef unsigned int by_second[256]  # byte -> the keys whose second byte it is (bits)
    cdef unsigned int one_byte = 0  # the keys of one byte (bits)
    cdef unsigned int candidates
    cdef int first = -1  # the first byte every key starts with, or -1: none shared
    cdef long long value = 0
    cdef long long values[MAX_COUNT_KEYS]  # per count, once found
    cdef bint found[MAX_COUNT_KEYS]
    cdef Py_ssize_t missing = 0  # counts not found yet that have a key to find
    cdef bytes key
    if len(counts) > MAX_COUNT_KEYS:
        raise ValueError(f"at most {MAX_COUNT_KEYS} counts")
    memset(by_second, 0, sizeof(by_second))
    memset(found, 0, sizeof(found))
    for index, keys in enumerate(counts):
        for key in <tuple> keys:
            m = PyBytes_GET_SIZE(key)
            if m == 0:
                continue  # found nowhere
            if count_keys == MAX_COUNT_KEYS:
                raise ValueError(f"at most {MAX_COUNT_KEYS} keys")
            names[count_keys] = <const unsigned char*> PyBytes_AS_STRING(key)
            sizes[count_keys] = m
            limits[count_keys] = n
            of_count[count_keys] = index
            if m == 1:
                one_byte |= 1u << count_keys
            else:
                by_second[names[count_keys][1]] |= 1u << count_keys
            if count_keys == 0:
                first = names[0][0]
            elif first != names[count_keys][0]:
                first = -1
            if count_keys == 0 or of_count[count_keys - 1] != index:
                missing += 1
            count_keys += 1
    i = n
    while missing:
        i -= 1
        if first >= 0:
            while i >= after and p[i] != first:
                i -= 1
        if i < after:
            break
        candidates = one_byte | (by_second[p[i + 1]] if i + 1 < n else 0)
        if not candidates:
            continue
        for j in range(count_keys):
            m = sizes[j]
            if (candidates >> j & 1 and i + m <= limits[j] and p[i] == names[j][0]
                    and memcmp(p + i, names[j], m) == 0):
                if _count_at(p, n, i + m, &value):
                    values[of_count[j]], found[of_count[j]] = value, True
                    missing -= 1
                    for k in range(count_keys):  # this count is found: its keys are looked for no more
                        if of_count[k] == of_count[j]:
                            limits[k] = -1
                else:
                    limits[j] = i
    result = PyTuple_New(len(counts))
    for j in range(len(counts)):
        item = values[j] if found[j] else None
        Py_INCREF(item)  # PyTuple_SET_ITEM steals the reference Cython keeps for `item`
        PyTuple_SET_ITEM(result, j, item)
    return result


# --- header_map: an ASGI request's headers as the mapping the router reads -------------------

from cpython.unicode cimport PyUnicode_DecodeLatin1


cdef inline str _latin1(raw):
    if type(raw) is bytes:
        return PyUnicode_DecodeLatin1(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), NULL)
    return raw.decode("latin-1")


def header_map(headers):
    """An ASGI request's headers ((name, value) byte strings, names lower-case) as {name: value},
    both decoded as latin-1, a later line of a name over an earlier: AsgiEdge's `headers`, made on
    every call. Its plain model is the dict comprehension in tests/test_edge_protocol.py."""
    cdef dict found = {}
    for name, value in headers:
        found[_latin1(name)] = _latin1(value)
    return found
