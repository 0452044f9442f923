"""Reading a request body: one `read_body` for every route that reads one (the proxied calls and
the admin API), and one answer for each way it fails.

Rules:
1. A body is read whole, up to `limit` bytes, before `deadline_s` (the event loop's clock). The
   CallClock keeps the deadline, as it keeps every call's (clock.py: no timer armed per body):
   past it, the reading task is cancelled and `read_body` raises BodyTimeout.
2. Raises BodyTooLarge (the declared length or the bytes read pass `limit`), ClientLeft (the
   client left mid-upload, or sent a body the server could not frame: a bad chunked encoding
   reads as a disconnect) or BodyTimeout; `refusal` gives each its answer: 413, 400, 408.
"""

from __future__ import annotations

import asyncio

from router.serve.clock import CallClock
from router.serve.edge import BodyTooLarge, Edge

# A client that stalls mid-upload must not hold a connection forever; a 64 MiB upload at
# 10 Mbit/s still fits (nginx's client_body_timeout is 60 s between reads, ours is the whole).
BODY_TIMEOUT_S = 60.0


def body_deadline(now_s: float) -> float:
    """The deadline of a body whose read starts at `now_s` (loop time)."""
    return now_s + BODY_TIMEOUT_S


class BodyTimeout(Exception):
    """The body did not arrive before its deadline."""


class _BodyRead:
    """One body being read, as the CallClock sees it."""

    __slots__ = ("task", "deadline_s", "overdue")

    def __init__(self, task: asyncio.Task, deadline_s: float) -> None:
        self.task = task
        self.deadline_s = deadline_s
        self.overdue = False

    def tick(self, now: float) -> None:
        if now > self.deadline_s and not self.overdue:
            self.overdue = True
            self.task.cancel()


async def read_body(edge: Edge, limit: int, deadline_s: float, clock: CallClock) -> bytes:
    """The request body (rule 1). Raises BodyTooLarge, ClientLeft, BodyTimeout (rule 2)."""
    task = asyncio.current_task()
    read = _BodyRead(task, deadline_s)  # type: ignore[arg-type]
    clock.calls.add(read)
    try:
        return await edge.read_body(limit)
    except asyncio.CancelledError:
        if not read.overdue:
            raise
        task.uncancel()  # type: ignore[union-attr]
        raise BodyTimeout() from None
    finally:
        clock.calls.discard(read)


def refusal(exc: Exception, limit: int) -> tuple[int, str, str]:
    """(status, code, message) answering a body `read_body` could not read (rule 2)."""
    if isinstance(exc, BodyTooLarge):
        return 413, "body_too_large", f"body over {limit} bytes"
    if isinstance(exc, BodyTimeout):
        return 408, "body_timeout", f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s"
    return 400, "bad_body", "the request body could not be read"
