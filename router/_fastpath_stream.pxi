# Included by router/_fastpath.pyx (the one compiled module).
#
# `FrameScanner`: finds the end of the first data frame of an SSE (blank-line separated) or
# NDJSON (newline separated) stream, split-invariant, and holds the bytes up to it so that the
# caller can judge it before anything reaches the client (`feed`, until its verdict is not
# HOLD). After it, the relay hands each chunk to `keep`, which keeps only the stream's tail: no
# chunk is scanned or copied. The plain model is tests/models.py's FrameScannerModel.
# `Relay`: the committed answer's bytes, box to client; a close-delimited SSE stream is complete
# only when its tail is `data: [DONE]`. The plain model is tests/models.py's RelayModel.

# Frame scanner verdicts (ints, not Enums: the plain model in tests reads alike).
HOLD = 0           # before the first data frame: the chunk is held, nothing may be sent
FIRST_CLEAN = 1    # the first data frame completed and has no "error" bytes in it
FIRST_SUSPECT = 2  # the first data frame completed and mentions "error": parse and judge it
TOO_BIG = 4        # no first frame within the hold limit: the box is not speaking the format

SSE = 1
NDJSON = 2

DEF TAIL = 32  # bytes of the stream's end kept to check how it ended


cdef class FrameScanner:
    cdef readonly int framing
    cdef long long bytes_in       # bytes seen: where a frame starts, and the hold limit's count
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
        chunk's last bytes are kept; its frames are not scanned."""
        self._keep_tail(PyBytes_AS_STRING(chunk), PyBytes_GET_SIZE(chunk))

    cdef bint _ends_with(self, const char* marker, Py_ssize_t size):
        """Whether the stream so far ends with `marker`, trailing whitespace aside (how a
        close-delimited stream tells a proper end from a box that died): the kept tail, read in
        place."""
        cdef int end = self.tail_len
        cdef char c
        while end > 0:
            c = self.tail[end - 1]
            if c != 32 and c != 9 and c != 13 and c != 10:
                break
            end -= 1
        return end >= size and memcmp(self.tail + end - size, marker, size) == 0

    cpdef int feed(self, bytes chunk) except -1:
        """Scans one chunk before the first frame's verdict; returns HOLD, FIRST_CLEAN,
        FIRST_SUSPECT or TOO_BIG. Raises ValueError once the first frame is judged (the rest is
        `keep`'s)."""
        cdef const char* start = PyBytes_AS_STRING(chunk)
        cdef Py_ssize_t size = PyBytes_GET_SIZE(chunk)
        cdef long long base = self.bytes_in
        cdef int verdict
        if self.relaying:
            raise ValueError("the first frame is judged: keep() the rest")
        self.held.append(chunk)
        self.bytes_in += size
        self._keep_tail(start, size)
        verdict = self._scan(start, start, start + size, base)
        if verdict == HOLD and self.bytes_in > self.hold_limit:
            return TOO_BIG
        return verdict

    cdef int _scan(self, const char* start, const char* p, const char* end, long long base) except -1:
        """Follows the frames in [p, end) of the chunk at `start` (stream offset `base`) up to the
        end of the first data frame, which it judges."""
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
                verdict = self._judge_block(base + (p - start))
                if verdict != HOLD:
                    self.relaying = True
                    return verdict
        return HOLD

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
