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
   chunk after the first frame; chunks pass through unchanged.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memchr, memcpy, memmove, memset

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

    def ends_with(self, bytes marker):
        """Whether the stream so far ends with `marker`, ignoring trailing whitespace (how a
        close-delimited stream tells a proper end from a box that died)."""
        cdef bytes tail = self.tail[: self.tail_len]
        return tail.rstrip(b" \t\r\n").endswith(marker)

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
