# cython: language_level=3
"""Compiled hot path: per-chunk and per-call arithmetic with no policy in it.

1. `Reservations`: the process-wide reservation table. Each reservation is stamped with the
   scheduler generation it was counted against. Rules (the plain model in
   tests/models.py states the same):
   a. reserve(box, g) counts one on `box`; g below the supersede floor is a misuse (ValueError).
   b. release(token) uncounts a live reservation once; a second release, or a release after the
      reservation was superseded, is ignored and returns False. Counts never go negative.
   c. move(token, box, g): a live reservation moves to `box` keeping its stamp; a stale one
      (released or superseded) becomes a fresh reservation on `box` at g.
   d. supersede(g): every live reservation stamped below g stops counting (the snapshot of
      generation g already counts it as pending); the floor rises to g.
2. `FrameScanner`: counts bytes and frames of an SSE (blank-line separated) or NDJSON
   (newline separated) stream, split-invariant, and holds the bytes up to the end of the first
   data frame so the caller can judge it before anything reaches the client. It never copies a
   chunk after the first frame; chunks pass through unchanged, and the relay hands them to
   `keep`, which keeps the stream's tail (for `ends_with`) without scanning their frames.
3. `json_members(body, names)`: checks that a request body is one JSON object (RFC 8259, UTF-8,
   nesting at most 1,024) and finds the byte spans of the top-level members `names`, keys
   compared as JSON decodes them, without building any object (a large body without the GIL). The plain
   model in tests/test_body.py is the stdlib parser.
4. `Relay`: the committed answer's bytes, box to client (module rule 2 for its stream's tail).
5. `form_field(body, delimiter, name)`: the byte span of text form field `name` in a
   multipart/form-data body, found by scanning part heads only (a large body without the GIL). Its plain
   model (the Python scan it replaced) is in tests/test_body.py.
6. `prefix_chain(body, start, end, seed)`: the affinity chain of a prompt, one hash per leading
   element, over raw bytes: the elements of the JSON array at body[start:end] (each element's
   bytes, outer whitespace left out), or the content of a JSON string cut into fixed blocks.
   h_0 = seed, h_i = mix(h_{i-1}, element i); nothing is decoded, nothing kept. Its plain model
   is in tests/models.py (prefix_chain_model).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdlib cimport malloc, realloc, free
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy, memmove, memset


cdef extern from "string.h" nogil:
    void* memmem(const void* haystack, size_t haystack_len, const void* needle, size_t needle_len)

IMPL = "cython"

# Frame scanner verdicts (ints, not Enums: the plain model in tests reads alike).
HOLD = 0           # before the first data frame: the chunk is held, nothing may be sent
FIRST_CLEAN = 1    # the first data frame completed and has no "error" bytes in it
FIRST_SUSPECT = 2  # the first data frame completed and mentions "error": parse and judge it
RELAY = 3          # after the first frame: send the chunk as it is
TOO_BIG = 4        # no first frame within the hold limit: the box is not speaking the format

SSE = 1
NDJSON = 2

DEF TAIL = 32  # bytes of the stream's end kept to check how it ended
# A body scan releases the GIL only from this size up (a large body is scanned on a worker
# thread while the loop runs). A small one keeps it: the scan takes ~0.3 µs, and a release lets
# a waiting thread (Granian's, the route-log writer) take the GIL, which the loop then waits to
# get back: json_fields showed as 6 % of the loop's samples under load with every scan released.
DEF RELEASE_GIL_BYTES = 64 * 1024
DEF SLOT_BITS = 20
DEF SLOT_MASK = (1 << SLOT_BITS) - 1


cdef class Reservations:
    cdef int* counts
    cdef int n_boxes
    cdef long long* slot_token
    cdef int* slot_box
    cdef long long* slot_gen
    cdef int* free_slots
    cdef int n_free
    cdef int n_slots
    cdef long long next_serial
    cdef readonly long long floor
    cdef readonly int live

    def __cinit__(self):
        self.n_boxes = 0
        self.counts = NULL
        self.n_slots = 0
        self.slot_token = NULL
        self.slot_box = NULL
        self.slot_gen = NULL
        self.free_slots = NULL
        self.n_free = 0
        self.next_serial = 1
        self.floor = 0
        self.live = 0
        self._grow_boxes(16)
        self._grow_slots(256)

    def __dealloc__(self):
        free(self.counts)
        free(self.slot_token)
        free(self.slot_box)
        free(self.slot_gen)
        free(self.free_slots)

    cdef void _grow_boxes(self, int need) except *:
        cdef int size = self.n_boxes if self.n_boxes else 16
        while size < need:
            size *= 2
        cdef int* grown = <int*> realloc(self.counts, size * sizeof(int))
        if grown == NULL:
            raise MemoryError()
        memset(grown + self.n_boxes, 0, (size - self.n_boxes) * sizeof(int))
        self.counts = grown
        self.n_boxes = size

    cdef void _grow_slots(self, int size) except *:
        if size > SLOT_MASK:
            raise MemoryError("reservation table full")
        cdef long long* tokens = <long long*> realloc(self.slot_token, size * sizeof(long long))
        if tokens == NULL:
            raise MemoryError()
        self.slot_token = tokens
        cdef int* boxes = <int*> realloc(self.slot_box, size * sizeof(int))
        if boxes == NULL:
            raise MemoryError()
        self.slot_box = boxes
        cdef long long* gens = <long long*> realloc(self.slot_gen, size * sizeof(long long))
        if gens == NULL:
            raise MemoryError()
        self.slot_gen = gens
        cdef int* free_slots = <int*> realloc(self.free_slots, size * sizeof(int))
        if free_slots == NULL:
            raise MemoryError()
        self.free_slots = free_slots
        cdef int slot
        for slot in range(size - 1, self.n_slots - 1, -1):
            self.slot_token[slot] = 0
            self.free_slots[self.n_free] = slot
            self.n_free += 1
        self.n_slots = size

    cpdef long long reserve(self, int box, long long generation) except -1:
        """Counts one call on `box`; returns its token (> 0)."""
        if box < 0:
            raise ValueError("box index must be >= 0")
        if generation < self.floor:
            raise ValueError(f"generation {generation} is below the supersede floor {self.floor}")
        if box >= self.n_boxes:
            self._grow_boxes(box + 1)
        if self.n_free == 0:
            self._grow_slots(self.n_slots * 2)
        self.n_free -= 1
        cdef int slot = self.free_slots[self.n_free]
        cdef long long token = (self.next_serial << SLOT_BITS) | slot
        self.next_serial += 1
        self.slot_token[slot] = token
        self.slot_box[slot] = box
        self.slot_gen[slot] = generation
        self.counts[box] += 1
        self.live += 1
        return token

    cdef inline int _slot_of(self, long long token):
        """The slot a live token holds, or -1 when the token is stale."""
        if token <= 0:
            return -1
        cdef int slot = <int> (token & SLOT_MASK)
        if slot >= self.n_slots or self.slot_token[slot] != token:
            return -1
        return slot

    cdef inline void _free(self, int slot):
        self.counts[self.slot_box[slot]] -= 1
        self.slot_token[slot] = 0
        self.free_slots[self.n_free] = slot
        self.n_free += 1
        self.live -= 1

    cpdef bint release(self, long long token):
        """Uncounts a live reservation; False (and nothing changes) for a stale token."""
        cdef int slot = self._slot_of(token)
        if slot < 0:
            return False
        self._free(slot)
        return True

    cpdef long long move(self, long long token, int box, long long generation) except -1:
        """Moves a live reservation to `box` (same token); a stale one becomes a new one."""
        cdef int slot = self._slot_of(token)
        if slot < 0:
            return self.reserve(box, generation)
        if box < 0:
            raise ValueError("box index must be >= 0")
        if box >= self.n_boxes:
            self._grow_boxes(box + 1)
        self.counts[self.slot_box[slot]] -= 1
        self.slot_box[slot] = box
        self.counts[box] += 1
        return token

    cpdef int supersede(self, long long generation):
        """Drops every live reservation stamped below `generation`; returns how many."""
        cdef int slot, dropped = 0
        if generation <= self.floor:
            return 0
        self.floor = generation
        for slot in range(self.n_slots):
            if self.slot_token[slot] != 0 and self.slot_gen[slot] < generation:
                self._free(slot)
                dropped += 1
        return dropped

    cpdef int count(self, int box):
        if box < 0 or box >= self.n_boxes:
            return 0
        return self.counts[box]


cdef class FrameScanner:
    cdef readonly int framing
    cdef readonly long long bytes_in
    cdef readonly long long frames
    cdef readonly bint relaying
    cdef Py_ssize_t hold_limit
    cdef Py_ssize_t line_len      # bytes on the current line so far, CRs included
    cdef bint prev_cr             # the last byte seen was a CR (it may end a CRLF)
    cdef bint block_has_content   # SSE: the current block has a non-empty line
    cdef long long block_start    # absolute offset of the current block (before first frame)
    cdef list held
    cdef readonly object first_data
    cdef char tail[TAIL]          # the last bytes seen, oldest first
    cdef int tail_len

    def __cinit__(self, int framing, Py_ssize_t hold_limit=1 << 20):
        if framing != SSE and framing != NDJSON:
            raise ValueError("framing must be SSE or NDJSON")
        self.framing = framing
        self.hold_limit = hold_limit
        self.bytes_in = 0
        self.frames = 0
        self.relaying = False
        self.line_len = 0
        self.prev_cr = False
        self.block_has_content = False
        self.block_start = 0
        self.held = []
        self.first_data = None
        self.tail_len = 0

    cdef inline void _keep_tail(self, const char* start, Py_ssize_t size):
        cdef int keep
        if size >= TAIL:
            memcpy(self.tail, start + size - TAIL, TAIL)
            self.tail_len = TAIL
            return
        keep = self.tail_len
        if keep + size > TAIL:
            keep = TAIL - <int> size
            memmove(self.tail, self.tail + self.tail_len - keep, keep)
        memcpy(self.tail + keep, start, size)
        self.tail_len = keep + <int> size

    cpdef void keep(self, bytes chunk):
        """After the first frame: only the stream's tail is needed (how it ended), so a relayed
        chunk is counted in `bytes_in` and its last bytes kept; its frames are not scanned."""
        cdef Py_ssize_t size = PyBytes_GET_SIZE(chunk)
        self.bytes_in += size
        self._keep_tail(PyBytes_AS_STRING(chunk), size)

    def ends_with(self, bytes marker):
        """Whether the stream so far ends with `marker`, ignoring trailing whitespace (how a
        close-delimited stream tells a proper end from a box that died). Looks at the kept
        tail in place: nothing is allocated, though it runs for every relayed chunk."""
        return self._ends_with(PyBytes_AS_STRING(marker), PyBytes_GET_SIZE(marker))

    cdef bint _ends_with(self, const char* marker, Py_ssize_t size):
        cdef int end = self.tail_len
        cdef char c
        while end > 0:
            c = self.tail[end - 1]
            if c != 32 and c != 9 and c != 13 and c != 10:
                break
            end -= 1
        return end >= size and memcmp(self.tail + end - size, marker, size) == 0

    cpdef int feed(self, bytes chunk) except -1:
        """Scans one chunk; returns HOLD, FIRST_CLEAN, FIRST_SUSPECT, RELAY or TOO_BIG."""
        cdef const char* start = PyBytes_AS_STRING(chunk)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(chunk)
        cdef long long base = self.bytes_in
        cdef int verdict
        if not self.relaying:
            self.held.append(chunk)
        self.bytes_in += size
        self._keep_tail(start, size)
        verdict = self._scan(start, start, start + size, base)
        if verdict == HOLD and self.bytes_in > self.hold_limit:
            return TOO_BIG
        return verdict

    cdef int _scan(self, const char* start, const char* p, const char* end, long long base) except -1:
        """Counts the frames in [p, end) of the chunk at `start` (stream offset `base`); while
        holding, the first data frame's end is judged, and the rest is counted after it."""
        cdef const char* nl
        cdef int verdict
        while p < end:
            nl = <const char*> memchr(p, 10, end - p)
            if nl == NULL:
                self._take(p, end)
                break
            self._take(p, nl)
            p = nl + 1
            if self._boundary():
                self.frames += 1
                if not self.relaying:
                    verdict = self._judge_block(base + (p - start))
                    if verdict != HOLD:
                        self.relaying = True
                        self._scan(start, p, end, base)
                        return verdict
        return RELAY if self.relaying else HOLD

    cdef inline void _take(self, const char* p, const char* end):
        """Adds the line bytes [p, end), remembering whether the last one is a CR."""
        cdef Py_ssize_t n = end - p
        if n > 0:
            self.line_len += n
            self.prev_cr = p[n - 1] == 13

    cdef inline bint _boundary(self):
        """Called at each LF: True when it closes a frame. A CR right before the LF is the
        line ending, not content, wherever the chunks were cut."""
        cdef bint closes
        cdef Py_ssize_t content = self.line_len - (1 if self.prev_cr else 0)
        self.prev_cr = False
        if self.framing == NDJSON:
            closes = content > 0
        elif content == 0:
            closes = self.block_has_content
            self.block_has_content = False
        else:
            self.block_has_content = True
            closes = False
        self.line_len = 0
        return closes

    cdef int _judge_block(self, long long boundary) except -1:
        """At the first frame boundary: a data block ends the hold, a comment block does not."""
        cdef bytes joined = b"".join(self.held)
        cdef long long held_base = self.bytes_in - len(joined)
        cdef bytes block = joined[self.block_start - held_base : boundary - held_base]
        self.block_start = boundary
        cdef list data = []
        cdef bytes line
        if self.framing == NDJSON:
            data.append(block.strip())
        else:
            for line in block.split(b"\n"):
                if line.endswith(b"\r"):
                    line = line[: len(line) - 1]
                if line.startswith(b"data:"):
                    line = line[5:]
                    data.append(line[1:] if line.startswith(b" ") else line)
            if not data:
                return HOLD  # a comment or event-only block: keep holding
        self.first_data = b"\n".join(data)
        return FIRST_SUSPECT if b"error" in self.first_data else FIRST_CLEAN

    def take_held(self):
        """The held chunks, unchanged, in order; the scanner holds nothing afterwards."""
        held = self.held
        self.held = []
        return held


# --- 3. json_members: the top-level members routing reads, found without building the body ----

DEF MAX_DEPTH = 1024      # nesting orjson also refuses past
DEF MAX_NAMES = 16  # a facade's routing members plus affinity's (model, alloc, stream, settings, 6 more)
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
    return tuple(
        (found.start[k], found.end[k], found.seen[k]) if found.seen[k] else None for k in range(found.count)
    )


# --- 4. form_field: one text field of a multipart/form-data body --------------------------------

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


cdef int _form_field(const unsigned char* p, Py_ssize_t n, const unsigned char* delimiter, Py_ssize_t dl,
                     const unsigned char* name, Py_ssize_t m, Py_ssize_t* span) noexcept nogil:
    cdef Py_ssize_t start = _find(p, n, 0, delimiter + 2, dl - 2)  # the first has no CRLF before it
    cdef Py_ssize_t head_start, head_end, next_start, line, line_end
    while start != -1:
        head_start = start + dl - 2
        if head_start + 2 <= n and p[head_start] == 45 and p[head_start + 1] == 45:
            return 0  # the closing delimiter
        head_end = _find(p, n, head_start, b"\r\n\r\n", 4)
        if head_end == -1:
            return 0
        next_start = _find(p, n, head_end + 4, delimiter, dl)
        if next_start == -1:
            return 0
        line = head_start
        while line <= head_end:
            line_end = _find(p, head_end, line, b"\r\n", 2)
            if line_end == -1:
                line_end = head_end
            if _line_names(p + line, line_end - line, name, m):
                span[0] = head_end + 4
                span[1] = next_start
                return 1
            line = line_end + 2
        start = next_start + 2
    return 0


def form_field(bytes body, bytes delimiter, bytes name):
    """The byte span (start, end) of text form field `name` (not a file part) in multipart body
    `body` whose parts are separated by `delimiter` (`--` + the boundary), or None when absent
    or the body ends first. A large body is scanned without the GIL.
    """
    cdef bytes separator = b"\r\n" + delimiter
    cdef const unsigned char* p = <const unsigned char*> PyBytes_AS_STRING(body)
    cdef const unsigned char* d = <const unsigned char*> PyBytes_AS_STRING(separator)
    cdef const unsigned char* f = <const unsigned char*> PyBytes_AS_STRING(name)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(body), dl = PyBytes_GET_SIZE(separator), m = PyBytes_GET_SIZE(name)
    cdef Py_ssize_t span[2]
    cdef int found
    if n >= RELEASE_GIL_BYTES:
        with nogil:
            found = _form_field(p, n, d, dl, f, m, span)
    else:
        found = _form_field(p, n, d, dl, f, m, span)
    return (span[0], span[1]) if found else None


cdef bytes SSE_DONE = b"data: [DONE]"


cdef class Relay:
    """Moves a committed answer from the box to the client: writes what was held, then each
    batch of chunks as it arrives, the chunks that arrived together in one write (a single chunk
    as it is, never copied). After the first frame a framed stream's chunks only update its tail
    (`FrameScanner.keep`). What `write` and `next_chunks` raise goes up to the caller, which reads
    how far the relay got (`bytes_out`, `delivered`, `last`, `data`) however it ended."""

    cdef readonly long long bytes_out
    # An SSE stream's end, `data: [DONE]`, went to the client's write: it stays so, whatever
    # follows (what was written is the client's).
    cdef readonly bint delivered
    cdef readonly bytes last      # the answer's last two writes, oldest first
    cdef readonly bytes data
    cdef readonly FrameScanner scanner
    cdef bint sse

    def __cinit__(self, FrameScanner scanner=None):
        self.scanner = scanner
        self.sse = scanner is not None and scanner.framing == SSE
        self.bytes_out = 0
        self.delivered = False
        self.last = b""
        self.data = b""

    def complete(self):
        """A close-delimited SSE stream ends with `data: [DONE]`: an EOF before it is a box that
        died, not a finished answer. Any other answer's end is its framing's."""
        return not self.sse or self.scanner._ends_with(PyBytes_AS_STRING(SSE_DONE), PyBytes_GET_SIZE(SSE_DONE))

    async def run(self, bytes first, write, next_chunks):
        cdef bytes data = first
        cdef list chunks
        cdef Py_ssize_t count, index
        cdef FrameScanner scanner = self.scanner
        while True:
            if PyBytes_GET_SIZE(data):
                self.last = self.data
                self.data = data
                self.bytes_out += PyBytes_GET_SIZE(data)
                if self.sse and scanner._ends_with(PyBytes_AS_STRING(SSE_DONE), PyBytes_GET_SIZE(SSE_DONE)):
                    self.delivered = True  # before the write, which the client's leaving can race
                await write(data)
            chunks = await next_chunks()
            count = len(chunks)
            if count == 0:
                return
            if scanner is not None:
                for index in range(count):
                    scanner.keep(chunks[index])
            data = chunks[0] if count == 1 else b"".join(chunks)


# --- 6. prefix_chain: the hash chain of a prompt's leading elements ----------------------------

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
