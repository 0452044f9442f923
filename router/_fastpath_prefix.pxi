# prefix_chain: the affinity chain of a prompt (router/_fastpath.pyx item 4). Rules:
# 1. One hash per leading element of the prompt value at body[start:end], over raw bytes: the
#    elements of a JSON array (each element's bytes, outer whitespace left out), or a JSON
#    string's content cut into BLOCK_BYTES blocks; any other value has no chain.
# 2. h_0 = seed, h_i = mix(h_{i-1}, element i): each hash stands for the prompt up to that
#    element. Nothing is decoded, nothing kept.
# 3. An element longer than 2 * EDGE_BYTES is mixed by its first and last EDGE_BYTES and its
#    length: a long message or tool output costs 512 bytes of hashing, not its whole size. Two
#    elements equal there but not in between make one hash; affinity then sends the call to a box
#    that holds that element's other version, whose cache still covers the prompt up to the
#    first difference (the sharing rule of router.core.affinity 3b sorts out the rest).
# 4. At most MAX_CHAIN elements; a span from json_members is valid JSON, so the scan trusts it.
# Its plain model is tests/models.py prefix_chain_model.

# A chain covers at most this many elements (a longer history matches at its 256th element on,
# which is as good for routing); a string prompt is cut into blocks of this many bytes (the last
# one partial), so a prompt that grows by appending keeps its earlier blocks' hashes.
DEF MAX_CHAIN = 256
DEF BLOCK_BYTES = 1024
DEF EDGE_BYTES = 256
cdef uint64_t PRIME_1 = 0x9E3779B97F4A7C15ULL  # 2^64 / golden ratio (Fibonacci hashing)
cdef uint64_t PRIME_2 = 0xC2B2AE3D27D4EB4FULL  # xxHash64's PRIME64_2
cdef uint64_t ELEMENT_MARK = 0x5BD1E9955BD1E995ULL  # separates elements: [ab][c] and [a][bc] differ
cdef uint64_t HASH_MASK = 0x3FFFFFFFFFFFFFFFULL

from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM


cdef extern from *:
    """
    /* The 128-bit product of a and b, its halves folded (wyhash's mum): one multiply mixes 16 bytes. */
    static inline uint64_t router_fold(uint64_t a, uint64_t b) {
        unsigned __int128 r = (unsigned __int128) a * b;
        return (uint64_t) r ^ (uint64_t) (r >> 64);
    }
    """
    uint64_t _fold "router_fold"(uint64_t a, uint64_t b) noexcept nogil


cdef inline uint64_t _mix(uint64_t h, const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Folds p[:n] into h: two independent lanes over each 32 bytes, each word pair through one
    128-bit multiply (the multiplies overlap), joined, then the rest 16 and 8 bytes at a time; the
    length goes in last. A word is never zeroed by its constant: PRIME_1 and PRIME_2 as bytes hold
    a control character or invalid UTF-8, which a valid JSON span never does."""
    cdef uint64_t a = h ^ ELEMENT_MARK, b = h + PRIME_2
    cdef uint64_t w0, w1, w2, w3
    cdef Py_ssize_t i = 0
    while i + 32 <= n:
        memcpy(&w0, p + i, 8)
        memcpy(&w1, p + i + 8, 8)
        memcpy(&w2, p + i + 16, 8)
        memcpy(&w3, p + i + 24, 8)
        a = _fold(w0 ^ a, w1 ^ PRIME_1)
        b = _fold(w2 ^ b, w3 ^ PRIME_2)
        i += 32
    h = _fold(a ^ PRIME_2, b ^ PRIME_1)
    if i + 16 <= n:
        memcpy(&w0, p + i, 8)
        memcpy(&w1, p + i + 8, 8)
        h = _fold(w0 ^ h, w1 ^ PRIME_1)
        i += 16
    if i + 8 <= n:
        memcpy(&w0, p + i, 8)
        h = _fold(w0 ^ h, PRIME_2)
        i += 8
    if i < n:
        w0 = 0
        memcpy(&w0, p + i, n - i)
        h = _fold(w0 ^ h, PRIME_1)
    return _fold(h ^ <uint64_t> n, PRIME_2)


cdef inline uint64_t _element(uint64_t h, const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Folds element p[:n] into h (rule 3): whole, or by its two edges and its length."""
    if n <= 2 * EDGE_BYTES:
        return _mix(h, p, n)
    return _mix(_mix(h, p, EDGE_BYTES) ^ <uint64_t> n, p + n - EDGE_BYTES, EDGE_BYTES)


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
            h = _element(h, p + first, last - first)
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
        h = _element(h, p + i, size)
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
    chain = PyTuple_New(count)
    for k in range(count):
        element = PyLong_FromUnsignedLongLong((out[k] & HASH_MASK) | 1)
        Py_INCREF(element)  # PyTuple_SET_ITEM steals the reference Cython keeps for `element`
        PyTuple_SET_ITEM(chain, k, element)
    return chain


# AffinityIndex: router.core.affinity's index (its rules 3, 7, 8), compiled: it runs on every call
# with a key (router.serve.affinity holds the process's one). Its plain model is tests/models.py
# AffinityIndexModel. The depths it is given are router.core.affinity's.

from collections import OrderedDict

from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject

# A node's state once two prompts continued it differently (core rule 3b).
SHARED = -1


cdef class AffinityIndex:
    """Bindings and prefix nodes, one LRU of at most `capacity` entries (core rules 3, 7, 8).

    A binding maps a scoped key's hash to a box name; a node maps a chain hash to
    (box, model key, epoch, state), state being the next element's hash (0: none seen yet) or
    SHARED. A key is core's Key (kind, bound, chain, scoped): a non-empty chain is a prefix key.
    `boxes` maps a box's name to its state, whose `cache_epoch(model_key)` is the box's current
    cache epoch for that model (a box not there is gone: its nodes are stale). Where a key points
    is a pull: a plain (box, depth) tuple, depth `bound_depth` for a binding; a node pulls from
    `min_depth` on.
    """

    cdef readonly Py_ssize_t capacity, min_depth
    cdef readonly object entries, bound_depth
    cdef object _move_to_end, _popitem

    def __init__(self, Py_ssize_t capacity, Py_ssize_t min_depth, bound_depth):
        self.capacity = capacity if capacity > 1 else 1
        self.min_depth = min_depth
        self.bound_depth = bound_depth
        self.entries = OrderedDict()
        self._move_to_end = self.entries.move_to_end
        self._popitem = self.entries.popitem

    def __len__(self):
        return len(self.entries)

    def pull(self, key, dict boxes):
        """Where `key` points now, or None (core rules 3 and 4): its binding, else the deepest
        node of its chain, unless that node is shared, or of another epoch than its box's now."""
        cdef tuple chain = (<tuple> key)[2]  # a Key, a tuple's subclass
        cdef tuple node
        cdef PyObject* found
        cdef PyObject* box
        cdef Py_ssize_t depth
        if not chain:
            found = PyDict_GetItem(self.entries, (<tuple> key)[1])
            if found == NULL:
                return None
            self._move_to_end((<tuple> key)[1])
            return (<object> found, self.bound_depth)
        for depth in range(len(chain), self.min_depth - 1, -1):
            found = PyDict_GetItem(self.entries, chain[depth - 1])
            if found == NULL:
                continue
            node = <tuple> found
            if node[3] == SHARED:
                return None
            box = PyDict_GetItem(boxes, node[0])
            if box == NULL or (<object> box).cache_epoch(node[1]) != node[2]:
                return None
            self._move_to_end(chain[depth - 1])
            return (node[0], depth)
        return None

    def learn(self, key, box, model_key, epoch, Py_ssize_t known=0):
        """`box` took the call: the binding moves there, its chain is recorded (core rule 7).
        `known`: the depth `pull` found on this same box, whose nodes and their ancestors' are as
        they would be written again: only the nodes past it are written (a conversation's turn
        costs its new elements, not its whole history)."""
        cdef tuple chain = (<tuple> key)[2]  # a Key, a tuple's subclass
        cdef Py_ssize_t index, last = len(chain) - 1
        cdef PyObject* found
        entries = self.entries
        if not chain:
            self._put((<tuple> key)[1], box)
            return
        for index in range((known if known > self.min_depth else self.min_depth) - 1, last + 1):
            node_hash = chain[index]
            following = chain[index + 1] if index < last else 0
            state = following
            found = PyDict_GetItem(entries, node_hash)
            if found != NULL:
                seen = (<tuple> found)[3]
                if seen == SHARED or (seen and following and seen != following):
                    state = SHARED
                elif not following:
                    state = seen
            entries[node_hash] = (box, model_key, epoch, state)
            if found != NULL:
                self._move_to_end(node_hash)  # a new key is already last
        self._trim()

    def bind(self, bound, box):
        """A binding made by an answer (a Responses id), not by the call's own key."""
        self._put(bound, box)

    cdef _put(self, bound, box):
        cdef bint known = PyDict_GetItem(self.entries, bound) != NULL
        self.entries[bound] = box
        if known:
            self._move_to_end(bound)
        self._trim()

    cdef _trim(self):
        while len(self.entries) > self.capacity:
            self._popitem(False)
