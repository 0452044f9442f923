"""The admin event streams (`GET /v1/router/events`, the dashboard's, and `GET
/v1/router/schedule`): bounded in number, and fed by one producer whatever their number (issue 20
item 12: 300 open streams, each building its own state document and reading the route log
every second, raised chat p50 from 2.6 to 41.8 ms).

Rules:
1. At most `max_streams` streams are open at once, both routes together (`--max-event-streams`,
   its default and reason in router.cli.main); one more gets 429 `too_many_streams` and opens
   nothing.
2. One producer task runs while a stream is open. Every STREAM_TICK_S, while a dashboard stream
   is open, it builds the tick's frames once: `series` (the points since the last tick), `state`
   (dashboard.state_doc) and `calls` (the route-log rows since the last tick, one read in a
   worker thread). It encodes each scheduler snapshot once, as `schedule:priority`. Every stream
   gets the same bytes: a stream's cost is a queue put and its own write.
3. A dashboard stream that joins gets a welcome first: the whole series up to the last tick, the
   last state and the newest TAIL_ROWS rows the producer holds (built once per tick, for every
   stream that joins in it), then each tick's frames. So nothing is read or built per stream.
4. A stream more than STREAM_BACKLOG frames behind (a client that stopped reading) is ended:
   a stalled page never grows the router's memory.
5. A schedule stream gets the `schedule:priority` frames only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from router.facades.openai import shape_error
from router.serve import dashboard
from router.serve.dashboard import SSE_HEADERS, STREAM_TICK_S, TAIL_ROWS, next_snapshot, sse_event, until_over
from router.store.route_log import ReadFailed

# Frames a stream may fall behind (about this many seconds): more is a client that stopped reading.
STREAM_BACKLOG = 64
ENDED = b""  # the frame that ends a stream (rule 4; the router's stop ends it otherwise)

log = logging.getLogger("router.serve")


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the event feed stopped: %r", task.exception())


class Listener:
    """One open stream's side of the feed."""

    __slots__ = ("frames", "dashboard", "welcomed")

    def __init__(self, everything: bool) -> None:
        self.frames: asyncio.Queue[bytes] = asyncio.Queue(STREAM_BACKLOG + 1)  # + room for ENDED
        self.dashboard = everything  # the dashboard's: every frame; else the schedule's only (rule 5)
        self.welcomed = False


class EventFeed:
    def __init__(self, process, max_streams: int) -> None:
        self.process = process
        self.max_streams = max_streams
        self.listeners: set[Listener] = set()
        self.task: asyncio.Task | None = None
        # What the producer holds between ticks (rule 3):
        self.ticked = False
        self.series_at = 0.0  # the last series point sent
        self.since = 0  # the last route-log id read
        self.rows: collections.deque[dict] = collections.deque(maxlen=TAIL_ROWS)
        self.state_frame = b""
        self.welcome: bytes | None = None  # built for the first stream that joins after a tick

    def join(self, everything: bool) -> Listener | None:
        """A new stream's listener (`everything`: the dashboard's, else the schedule's); None when
        `max_streams` are open (rule 1)."""
        if len(self.listeners) >= self.max_streams:
            return None
        listener = Listener(everything)
        self.listeners.add(listener)
        if everything and self.ticked:
            self._send(listener, self._welcome())
        if self.task is None or self.task.done():  # (done: it failed, and said so in the log)
            self.task = asyncio.get_running_loop().create_task(self._produce(), name="event-feed")
            self.task.add_done_callback(_log_failure)
        return listener

    def leave(self, listener: Listener) -> None:
        self.listeners.discard(listener)
        if not self.listeners and self.task is not None:
            self.task.cancel()
            self.task = None
            self.ticked = False  # the next producer starts afresh (rule 3: nothing is stale)
            self.series_at, self.since, self.welcome = 0.0, 0, None
            self.rows.clear()

    def _send(self, listener: Listener, frame: bytes) -> None:
        listener.welcomed = True
        try:
            listener.frames.put_nowait(frame)
        except asyncio.QueueFull:  # rule 4
            self.listeners.discard(listener)
            listener.frames.get_nowait()
            listener.frames.put_nowait(ENDED)

    def _welcome(self) -> bytes:
        if self.welcome is None:
            history = [p for p in self.process.metrics.series.points if p["at"] <= self.series_at]
            frames = [sse_event(b"series", {"points": history}), self.state_frame]
            if self.rows:
                frames.append(sse_event(b"calls", {"rows": list(self.rows)}))
            self.welcome = b"".join(frames)
        return self.welcome

    async def _produce(self) -> None:
        scheduler = self.process.scheduler
        queue = scheduler.subscribe()
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        try:
            while True:
                if loop.time() >= next_tick:
                    next_tick = loop.time() + STREAM_TICK_S
                    if any(listener.dashboard for listener in self.listeners):
                        await self._tick()
                try:
                    async with asyncio.timeout(max(0.0, next_tick - loop.time())):
                        snapshot = await queue.get()
                except TimeoutError:
                    continue
                frame = sse_event(b"schedule:priority", snapshot.to_event())
                for listener in list(self.listeners):
                    if listener.welcomed or not listener.dashboard:
                        self._send(listener, frame)
        finally:
            scheduler.unsubscribe(queue)

    async def _tick(self) -> None:
        """Rule 2. The route-log read comes first: everything after it runs without a pause, so
        a stream that joins in between gets either this tick's welcome or its frames, never both."""
        process = self.process
        try:
            rows = await asyncio.get_running_loop().run_in_executor(
                None, dashboard.route_log_tail, process.route_log, self.since, TAIL_ROWS)
        except ReadFailed:
            rows = []  # the store is busy or gone: the next tick tries again
        frames = []
        points = [p for p in process.metrics.series.points if p["at"] > self.series_at]
        if points or not self.ticked:
            self.series_at = points[-1]["at"] if points else time.time()
            frames.append(sse_event(b"series", {"points": points}))
        self.state_frame = sse_event(b"state", dashboard.state_doc(process))
        frames.append(self.state_frame)
        if rows:
            self.since = rows[-1]["id"]
            self.rows.extend(rows)
            frames.append(sse_event(b"calls", {"rows": rows}))
        self.ticked = True
        self.welcome = None
        tick = b"".join(frames)
        for listener in list(self.listeners):
            if listener.dashboard:
                self._send(listener, tick if listener.welcomed else self._welcome())


async def _stream(app, edge, everything: bool) -> None:
    """One stream, until its client leaves, the router stops, or it falls behind (rule 4)."""
    process = app.process
    feed: EventFeed = process.events
    listener = feed.join(everything)
    if listener is None:  # rule 1
        body = shape_error(429, "too_many_streams",
                           f"{feed.max_streams} event streams are open, the most this router allows "
                           "(--max-event-streams)", None)
        await edge.respond(429, [(b"content-type", b"application/json"), (b"retry-after", b"5")], body)
        return
    gone, end_watch = until_over(process, edge)
    try:
        await edge.start(200, list(SSE_HEADERS))
        while frame := await next_snapshot(listener.frames, gone, None):
            await edge.write(frame)
        await edge.finish()
    finally:
        end_watch()
        feed.leave(listener)


async def events(app, edge) -> None:
    """`GET /v1/router/events`: the dashboard's stream (dashboard.py rule 3)."""
    await _stream(app, edge, everything=True)


async def schedule(app, edge) -> None:
    """`GET /v1/router/schedule`: `schedule:priority` events, one per published snapshot."""
    await _stream(app, edge, everything=False)
