"""Scripted behaviours: what a test or the fault suite makes a simulated box do for one call
instead of its normal answer, and the two answers every kind writes the same way (`raw` and
`stall_body`).

Rules:
1. A behaviour is a frozen value built by one of `Behavior`'s constructors; a box queues them
   per model (`script`) and takes one per call, FIFO, once each.
2. Every kind answers `hang`, `reset`, `refuse` (and `busy`), `in_band`, `die_after`,
   `stall_after` and `raw` (and `cut`); `refuse` and `in_band` in its own error dialect (see
   its module docstring). `drop`, `linger`, `bad_head`, `trickle` and `stall_body` are the
   hugpy box's; any other kind answers them with a reset.
3. STREAM_FAULTS are applied by the stream as it goes (the box's `_stream`): the call goes on,
   the stream dies or stalls after `chunks` content frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.sim.connection import Connection, Exchange, Steps

# The scripted behaviours a stream applies as it goes (`_stream`), rather than answered at once.
STREAM_FAULTS = frozenset({"die_after", "stall_after"})
BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"  # sic: two spaces


@dataclass(frozen=True, slots=True)
class Behavior:
    """One scripted answer for one call; build it with the constructors below. Each box kind
    writes it in its own error dialect (see its module docstring)."""

    kind: str
    status: int = 0
    type: str | None = None
    message: str = ""
    code: int | str | None = None
    seconds: float = 0.0
    chunks: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    clean: bool = True  # die_after, drop, cut: FIN (True) or RST (False)
    size: int = 0  # trickle: bytes per write
    cut_at: int = -1  # raw: body bytes sent before the connection is cut (-1: the whole body)
    length: bool = True  # raw: with a Content-Length (False: close-delimited)

    @staticmethod
    def refuse(status: int, type: str | None, message: str = "refused by the simulated box",
               code: int | str | None = None) -> Behavior:
        """A JSON error with that status before any byte of success; `code` defaults to the
        status, `type=None` leaves `type` out (the box's untyped errors)."""
        return Behavior("refuse", status=status, type=type, message=message,
                        code=status if code is None else code)

    @staticmethod
    def busy() -> Behavior:
        """Ollama's queue-full answer: 503 `server busy, please try again.  maximum pending
        requests exceeded` (a `refuse`, so every kind can be scripted with it)."""
        return Behavior.refuse(503, None, BUSY_MESSAGE)

    @staticmethod
    def in_band(type: str | None = None, message: str = "refused by the simulated box",
                code: int | str = 503) -> Behavior:
        """Stream: a 200 stream head, one error frame or line in the kind's dialect, end.
        Non-stream: the same as `refuse(code, type)` (503 unless `code` is an int status)."""
        return Behavior("in_band", status=code if isinstance(code, int) else 503, type=type,
                        message=message, code=code)

    @staticmethod
    def hang(seconds: float) -> Behavior:
        """Send nothing for `seconds`, then answer normally."""
        return Behavior("hang", seconds=seconds)

    @staticmethod
    def reset() -> Behavior:
        """Close the socket (RST) without any response byte."""
        return Behavior("reset")

    @staticmethod
    def die_after(chunks: int, clean: bool = True) -> Behavior:
        """Stream: head, lead-in frames, `chunks` content frames, then close (no final frame):
        with `clean` (the default) an orderly close (FIN, what a crashed process's kernel
        sends), else an abortive one (RST). A chunked stream (ollama, lmstudio) is cut without
        its last chunk; those kinds always close with FIN. Non-stream: like `reset()`, since
        there is no partial JSON answer."""
        return Behavior("die_after", chunks=chunks, clean=clean)

    @staticmethod
    def stall_after(chunks: int, seconds: float) -> Behavior:
        """Stream: head, lead-in frames, `chunks` content frames, then `seconds` of silence with
        the connection open, then the rest as normal (a box stuck mid-answer). Non-stream: like
        `hang(seconds)`."""
        return Behavior("stall_after", chunks=chunks, seconds=seconds)

    @staticmethod
    def drop(after_s: float = 0.0, clean: bool = True) -> Behavior:
        """The box takes the call (it is recorded), then after `after_s` closes the connection
        without sending a byte: FIN when `clean`, else RST. (hugpy boxes; the other kinds answer
        unknown behaviours with a reset.)"""
        return Behavior("drop", seconds=after_s, clean=clean)

    @staticmethod
    def linger(seconds: float) -> Behavior:
        """The normal answer, but a close-delimited stream stays open `seconds` after its last
        frame (`data: [DONE]`) before the box closes it, as a box busy tearing down may. Each
        burst of the stream's writes goes out as one write: without a cadence the head, every
        frame and [DONE] reach the client in one piece. (hugpy boxes; the other kinds answer
        unknown behaviours with a reset.)"""
        return Behavior("linger", seconds=seconds)

    @staticmethod
    def bad_head() -> Behavior:
        """An answer whose status line no HTTP parser accepts (`HTTP/1.1 2OO OK`), then close.
        The call is recorded first: the box took it and then broke HTTP. (hugpy boxes; the
        other kinds answer unknown behaviours with a reset.)"""
        return Behavior("bad_head")

    @staticmethod
    def trickle(chunk_bytes: int, interval_s: float) -> Behavior:
        """The normal answer (stream or not, head included), written `chunk_bytes` at a time
        with `interval_s` between writes; the call ends when the last byte is out. (hugpy
        boxes; the other kinds answer unknown behaviours with a reset.)"""
        if chunk_bytes < 1 or interval_s < 0:
            raise ValueError("trickle needs chunk_bytes >= 1 and interval_s >= 0")
        return Behavior("trickle", size=chunk_bytes, seconds=interval_s)

    @staticmethod
    def raw(status: int, headers: list[tuple[str, str]], body: bytes) -> Behavior:
        """Answer exactly this (Content-Length is added)."""
        return Behavior("raw", status=status, headers=tuple(headers), body=body)

    @staticmethod
    def stall_body(status: int, headers: list[tuple[str, str]], body: bytes, after_bytes: int,
                   seconds: float) -> Behavior:
        """Like `raw` with a Content-Length, but after `after_bytes` of the body the box goes
        silent for `seconds`, connection open, then sends the rest. (hugpy boxes; the other
        kinds answer unknown behaviours with a reset.)"""
        if not 0 <= after_bytes <= len(body):
            raise ValueError("after_bytes must be within the body")
        return Behavior("stall_body", status=status, headers=tuple(headers), body=body, cut_at=after_bytes,
                        seconds=seconds)

    @staticmethod
    def cut(status: int, headers: list[tuple[str, str]], body: bytes, after_bytes: int, *,
            clean: bool = True, length: bool = True) -> Behavior:
        """Like `raw`, but the connection is cut after `after_bytes` of the body: closed with a
        FIN when `clean`, else an RST. With `length` the head declares the whole body's
        Content-Length (so the cut is visible to any client); without, the answer is
        close-delimited (`Connection: close`, no length), where only an RST marks the cut.
        An RST drops whatever the kernel has not sent yet, so at most `after_bytes` arrive.
        Every kind answers it (it is a `raw` behaviour)."""
        if not 0 <= after_bytes <= len(body):
            raise ValueError("after_bytes must be within the body")
        return Behavior("raw", status=status, headers=tuple(headers), body=body, cut_at=after_bytes,
                        clean=clean, length=length)


def _raw_parts(behavior: Behavior) -> tuple[bytes, list[tuple[str, str]]]:
    """A `raw` answer's Content-Type (defaulted) and its other headers."""
    content_type = next((v.encode("latin-1") for n, v in behavior.headers if n.lower() == "content-type"),
                        b"application/octet-stream")
    extra = [(n, v) for n, v in behavior.headers if n.lower() not in ("content-type", "content-length")]
    return content_type, extra


def answer_raw(conn: Connection, ex: Exchange, behavior: Behavior) -> None:
    """Writes a `Behavior.raw` answer: its status, headers and body as given."""
    content_type, extra = _raw_parts(behavior)
    if behavior.cut_at < 0:
        conn.respond(ex, behavior.status, behavior.body, content_type, extra)
        return
    # Behavior.cut: the head (with the whole length, or close-delimited), part of the body, cut.
    ex.keep_alive = behavior.length  # close-delimited: the head says Connection: close
    head = conn.head(ex, behavior.status, content_type, extra)
    if behavior.length:
        head += (b"Content-Length: ", str(len(behavior.body)).encode(), b"\r\n")
    head += (b"\r\n", behavior.body[:behavior.cut_at])
    conn.write(b"".join(head))
    conn.cut(behavior.clean)


def answer_stalled_body(conn: Connection, ex: Exchange, behavior: Behavior) -> Steps:
    """Generator: a `Behavior.stall_body` answer: head and the first bytes, silence, the rest."""
    head = conn.head(ex, behavior.status, *_raw_parts(behavior))
    head += (b"Content-Length: ", str(len(behavior.body)).encode(), b"\r\n\r\n", behavior.body[:behavior.cut_at])
    conn.write(b"".join(head))
    yield behavior.seconds
    conn.write(behavior.body[behavior.cut_at:])
    if not ex.keep_alive:
        conn.close()
