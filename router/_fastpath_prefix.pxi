# prefix_chain: the affinity chain of a prompt (router/_fastpath.pyx item 4). Rules:
# 1. One hash per leading element of the prompt value at body[start:end], over raw bytes: the
#    elements of a JSON array (each element's bytes, outer whitespace left out), or a JSON
#    string's content cut into BLOCK_BYTES blocks; any other value has no chain.
# 2. h_0 = seed, h_i = mix(h_{i-1}, element i): each hash stands for the prompt up to that
#    element. Nothing is decoded, nothing kept.
# 3. At most MAX_CHAIN elements; a span from json_members is valid JSON, so the scan trusts it.
# Its plain model is tests/models.py prefix_chain_model.

# A chain covers at most this many elements (a longer history matches at its 256th element on,
# which is as good for routing); a string prompt is cut into blocks of this many bytes (the last
# one partial), so a prompt that grows by appending keeps its earlier blocks' hashes.
DEF MAX_CHAIN = 256
DEF BLOCK_BYTES = 1024
cdef uint64_t PRIME_1 = 0x9E3779B97F4A7C15ULL  # 2^64 / golden ratio (Fibonacci hashing)
cdef uint64_t PRIME_2 = 0xC2B2AE3D27D4EB4FULL  # xxHash64's PRIME64_2
cdef uint64_t ELEMENT_MARK = 0x5BD1E9955BD1E995ULL  # separates elements: [ab][c] and [a][bc] differ
cdef uint64_t HASH_MASK = 0x3FFFFFFFFFFFFFFFULL


cdef inline uint64_t _round(uint64_t lane, uint64_t word) noexcept nogil:
    lane = (lane ^ word) * PRIME_1
    return lane ^ (lane >> 32)


cdef inline uint64_t _mix(uint64_t h, const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Folds p[:n] into h: four independent lanes over each 32 bytes (the multiplies overlap:
    ~4x one lane's speed), joined, then the rest 8 bytes at a time; the length goes in last."""
    cdef uint64_t a = h ^ ELEMENT_MARK, b = h + PRIME_2, c = h ^ PRIME_1, d = h - ELEMENT_MARK
    cdef uint64_t w0, w1, w2, w3
    cdef Py_ssize_t i = 0
    while i + 32 <= n:
        memcpy(&w0, p + i, 8)
        memcpy(&w1, p + i + 8, 8)
        memcpy(&w2, p + i + 16, 8)
        memcpy(&w3, p + i + 24, 8)
        a = _round(a, w0)
        b = _round(b, w1)
        c = _round(c, w2)
        d = _round(d, w3)
        i += 32
    h = _round(_round(_round(a, b), c), d)
    while i + 8 <= n:
        memcpy(&w0, p + i, 8)
        h = _round(h, w0)
        i += 8
    if i < n:
        w0 = 0
        memcpy(&w0, p + i, n - i)
        h = _round(h, w0)
    h = (h ^ <uint64_t> n) * PRIME_2
    return h ^ (h >> 29)


cdef inline Py_ssize_t _string_close(const unsigned char* p, Py_ssize_t i, Py_ssize_t end) noexcept nogil:
    """The index of the quote that closes the (valid) string whose content starts at `i`: the
    first quote after an even run of backslashes."""
    cdef const unsigned char* quote
    cdef Py_ssize_t j, k
    while True:
        quote = <const unsigned char*> memchr(p + i, 34, end - i)
        j = quote - p
        k = j
        while k > i and p[k - 1] == 92:
            k -= 1
        if (j - k) % 2 == 0:
            return j
        i = j + 1


cdef int _array_chain(const unsigned char* p, Py_ssize_t i, Py_ssize_t end, uint64_t h,
                      uint64_t* out) noexcept nogil:
    """p[i:end] is a valid JSON array: the chain of its elements into `out`; their count."""
    cdef int count = 0, depth = 0
    cdef Py_ssize_t first, last
    cdef unsigned char c
    i = _skip_ws(p, i + 1, end)
    if i >= end or p[i] == 93:  # ]
        return 0
    first = i
    while i < end and count < MAX_CHAIN:
        c = p[i]
        if c == 34:  # a string: skip it whole (valid JSON, so it closes); memchr finds each quote
            i = _string_close(p, i + 1, end) + 1
            continue
        if c == 123 or c == 91:
            depth += 1
        elif c == 125 or (c == 93 and depth > 0):
            depth -= 1
        elif depth == 0 and (c == 44 or c == 93):  # , or the array's own ]
            last = i
            while last > first and (p[last - 1] == 32 or p[last - 1] == 10 or p[last - 1] == 13 or p[last - 1] == 9):
                last -= 1
            h = _mix(h, p + first, last - first)
            out[count] = h
            count += 1
            if c == 93:
                break
            i = _skip_ws(p, i + 1, end)
            first = i
            continue
        i += 1
    return count


cdef int _string_chain(const unsigned char* p, Py_ssize_t i, Py_ssize_t end, uint64_t h,
                       uint64_t* out) noexcept nogil:
    """p[i:end] is a JSON string: the chain of its content's blocks into `out`; their count."""
    cdef int count = 0
    cdef Py_ssize_t size
    i += 1
    end -= 1  # the closing quote
    while i < end and count < MAX_CHAIN:
        size = end - i if end - i < BLOCK_BYTES else BLOCK_BYTES
        h = _mix(h, p + i, size)
        out[count] = h
        count += 1
        i += size
    return count


cdef inline int _chain(const unsigned char* p, Py_ssize_t start, Py_ssize_t end, uint64_t seed,
                       uint64_t* out) noexcept nogil:
    if p[start] == 91:  # [
        return _array_chain(p, start, end, seed, out)
    if p[start] == 34:  # "
        return _string_chain(p, start, end, seed, out)
    return 0


def prefix_chain(bytes body, Py_ssize_t start, Py_ssize_t end, uint64_t seed):
    """The chain of hashes of the prompt value at body[start:end] (a span json_members found, so
    valid JSON): one per array element, or per BLOCK_BYTES of a string's content; () for any
    other value. Each hash is a positive int below 2^62, never 0. A large span is hashed
    without the GIL. Raises ValueError for a span outside the body."""
    cdef uint64_t out[MAX_CHAIN]
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(body)
    cdef int count = 0, k
    if start < 0 or end > PyBytes_GET_SIZE(body) or start >= end:
        raise ValueError("span outside the body")
    if end - start >= RELEASE_GIL_BYTES:
        with nogil:
            count = _chain(p, start, end, seed, out)
    else:
        count = _chain(p, start, end, seed, out)
    return tuple([(out[k] & HASH_MASK) | 1 for k in range(count)])
