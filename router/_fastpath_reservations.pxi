# Included by router/_fastpath.pyx (the one compiled module).
#
# `Reservations`: the process-wide reservation table. Each reservation is stamped with the
# scheduler generation it was counted against. Rules (the plain model in tests/models.py states
# the same):
#   a. reserve(box, g) counts one on `box`; g below the supersede floor is a misuse (ValueError).
#   b. release(token) uncounts a live reservation once; a second release, or a release after the
#      reservation was superseded, is ignored and returns False. Counts never go negative.
#   c. move(token, box, g): a live reservation moves to `box` keeping its stamp; a stale one
#      (released or superseded) becomes a fresh reservation on `box` at g.
#   d. supersede(g): every live reservation stamped below g stops counting (the snapshot of
#      generation g already counts it as pending); the floor rises to g.

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
