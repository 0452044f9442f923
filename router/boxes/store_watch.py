"""The hugpy store watch: a box whose `fitevict.sqlite3` is readable on this machine is followed
through the file instead of the state long-poll (contracts/hugpy-wrapper.md §2.3, §3;
contracts/stack-notes.md §4).

Rules:
1. Which rows. The store may hold several wrappers' rows; each row's `worker` is the box's
   FITEVICT_WORKER, which must be the box's name in our boxes file. Every SELECT filters on
   `worker = <box name>`. A store whose catalog holds other workers' rows and no catalog or
   resident row of ours is not this box's store (rule 7).
2. What is read. `residents`, `models` and `gpu_state`, only the columns `parse_state` reads
   (`hugpy.STATE_COLUMNS`), inside one read transaction together with `PRAGMA data_version`,
   so the view is one snapshot and the version is the one it was read at. `parse_state` turns
   the rows into the Inventory, exactly as for the API's rows.
3. Noticing commits. Hooks never fire for another process's commits, so: inotify on the
   store's directory (the `-wal` file is deleted and recreated as connections come and go),
   events filtered to the store's own file names; after an event, `PRAGMA data_version` says
   whether a commit is visible. The event can come before the writer updates the wal-index,
   so an unmoved version is checked again after each of `RECHECK_DELAYS_S`; a new event
   during that schedule is checked at once and restarts it. A safety poll every
   `SAFETY_POLL_S` catches coalesced, overflowed or missing events (a network filesystem has
   none); without inotify at all the poll runs every `NO_INOTIFY_POLL_S`.
4. Publishing. `data_version` also moves on the box's silent 4 Hz sensor writes (residents'
   vram_bytes, ram_bytes, cpu_ms, last_used, observed_at; gpu/host/cpu rows), so every
   confirmed change is re-read but published only when the view the decision reads moved:
   catalog, free GPU bytes, the seats and their healthy/loading/busy flags, the pair settings. `last_used` (the
   serving tier's most-recently-used tie-break between boxes) moves whenever a call ends, in a
   silent write when the seat stays busy; it counts only when it moved more than
   `LAST_USED_SLACK_S` from the published value: seats used within a second of each other are
   equally warm, and every published view carries the fresh values.
5. The loop. Opening the file runs in the default executor (it may touch the disk and create
   the `-shm`). The check and the re-read run on the event loop: measured on the 2-core dev
   box with 100 catalog rows, 5 seats and 1 card, an unchanged check takes 4.5 µs median and
   a changed one (read transaction, row dicts, `parse_state`, diff) 90 µs median, against
   73 µs median for one executor round trip, which would still hold the GIL for the Python
   half of the work. The busy timeout is `BUSY_TIMEOUT_MS`, so a read never stalls the loop
   longer; a busy store counts as "not visible yet" (rule 3 retries). A read that found a
   commit is followed by `MIN_READ_GAP_S` without reads, which bounds the loop time a box
   under traffic (3-5 commits per call) can take.
6. Replacement. hugpy renames a corrupt store and creates a new file (§3.1), whose commits
   the open connection never sees: every recheck and safety poll compares the path's device
   and inode with the opened file's, and the link re-opens on a change.
7. Fallback. A missing or unreadable file, one that is not a database or lacks the tables,
   or the wrong worker's store: logged once per distinct reason, and the link follows the API
   long-poll instead (`mode` says which). A read that fails later restarts the link through
   the guard (link.py rule 2), which tries the file again first. `/health` decides online in
   both modes.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import struct
from dataclasses import replace

import apsw

from router.boxes.hugpy import STATE_COLUMNS, HugpyLink, parse_state
from router.boxes.link import InventoryError
from router.boxes.state import BoxState, Inventory

log = logging.getLogger("router.boxes")

# stack-notes §4: 21 of 490 events came before the wal-index update. uvloop timers have 1 ms
# resolution (call_later rounds delay * 1000 to an integer, so the spike's 0.5 ms would be
# `call_soon`). Doubling delays cover a writer descheduled for ~30 ms on a busy box in five
# checks; a commit writes the WAL in several write() calls, so some events come after their
# commit was already read and all their checks fail: five keep those cheap. A later commit or
# the safety poll covers the rest.
RECHECK_DELAYS_S = (0.001, 0.002, 0.004, 0.008, 0.016)
SAFETY_POLL_S = 1.0
# stack-notes §4: polling data_version every 10 ms costs ~1 % CPU; 20 ms halves that and still
# shows a change within the 50 ms the store watch is for.
NO_INOTIFY_POLL_S = 0.02
# 100 changed reads/s at most: under 1 % of the loop at the measured 90 µs each (rule 5), and
# the view lags a burst by 10 ms, 25x less than the API link's MIN_POLL_GAP_S.
MIN_READ_GAP_S = 0.01
LAST_USED_SLACK_S = 1.0
# A WAL reader is only refused while a crashed writer's WAL is being recovered; waiting out
# that on the loop would stall every call, so wait 2 ms (SQLite's busy handler sleeps 1 ms,
# then the 1 ms left) and retry on the rule 3 schedule.
BUSY_TIMEOUT_MS = 2
OPEN_BUSY_TIMEOUT_MS = 1000  # the open runs in the executor, where waiting out a recovery is fine

# <sys/inotify.h>
IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_Q_OVERFLOW = 0x4000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCH_MASK = IN_MODIFY | IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of name
READ_BYTES = 64 * 1024  # many events per read(); the queue is drained in a loop anyway

_libc = ctypes.CDLL(None, use_errno=True)


class StoreUnusable(Exception):
    """The store file cannot serve as this box's inventory (rule 7); the text says why."""


class StoreReader:
    """One read-only connection to a box's store, filtered to one worker (rules 1, 2)."""

    def __init__(self, path: str, worker: str) -> None:
        """Opens the file and reads it once. Raises StoreUnusable. Blocking: run it in an executor."""
        self.path = path
        self.worker = worker
        self.version: int | None = None
        try:
            st = os.stat(path)
            self.identity = (st.st_dev, st.st_ino)
            self.conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
        except (OSError, apsw.Error) as exc:
            raise StoreUnusable(f"cannot open: {exc}") from None
        try:
            self.first = self._first_read()
        except StoreUnusable:
            self.conn.close()
            raise

    def _first_read(self) -> dict:
        """The first read, with the checks of rules 1 and 7. Raises StoreUnusable."""
        try:
            self.conn.set_busy_timeout(OPEN_BUSY_TIMEOUT_MS)
            first = self.read_if_changed()
            self.conn.set_busy_timeout(BUSY_TIMEOUT_MS)
            if first is None:
                raise StoreUnusable(f"busy for {OPEN_BUSY_TIMEOUT_MS} ms")
            if first["models"] or first["residents"]:
                return first
            others = [w for (w,) in self.conn.execute("SELECT DISTINCT worker FROM models LIMIT 5")]
        except apsw.Error as exc:
            raise StoreUnusable(f"cannot read: {exc}") from None
        if others:
            raise StoreUnusable(f"no rows for worker {self.worker!r} (the store holds {', '.join(others)})")
        return first

    def replaced(self) -> bool:
        """Whether the path now names another file than the one open (rule 6)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def read_if_changed(self) -> dict | None:
        """The rows of rule 2 when `data_version` moved since the last read, else None.

        A busy store returns None (rule 5). Raises apsw.Error when the file fails otherwise.
        """
        conn = self.conn
        conn.execute("BEGIN")
        try:
            ((version,),) = conn.execute("PRAGMA data_version")
            if version == self.version:
                return None
            doc = {
                table: [
                    dict(zip(columns, row))
                    for row in conn.execute(
                        f"SELECT {', '.join(columns)} FROM {table} WHERE worker = ?", (self.worker,)
                    )
                ]
                for table, columns in STATE_COLUMNS.items()
            }
        except apsw.BusyError:
            return None
        finally:
            conn.execute("COMMIT")
        self.version = version
        return doc

    def close(self) -> None:
        self.conn.close()


def watch_directory(path: str) -> int | None:
    """A non-blocking inotify fd watching the folder of `path` (rule 3), or None (logged)."""
    fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
    if fd < 0:
        log.warning("store %s: no inotify (%s): polling", path, os.strerror(ctypes.get_errno()))
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if _libc.inotify_add_watch(fd, os.fsencode(folder), WATCH_MASK) < 0:
        log.warning("store %s: cannot watch %s (%s): polling", path, folder, os.strerror(ctypes.get_errno()))
        os.close(fd)
        return None
    return fd


def drain(fd: int, prefix: bytes) -> bool:
    """Empties the inotify queue. Returns whether an event named a file starting with
    `prefix` (the store, its -wal, its -shm) or the queue overflowed."""
    hit = False
    while True:
        try:
            data = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return hit
        offset = 0
        while offset < len(data):
            _, mask, _, length = EVENT_HEADER.unpack_from(data, offset)
            offset += EVENT_HEADER.size
            hit = hit or bool(mask & IN_Q_OVERFLOW) or data[offset : offset + length].startswith(prefix)
            offset += length


def moved(old: Inventory, new: Inventory) -> bool:
    """Whether `new` differs from the published `old` in what the decision reads (rule 4)."""
    if (old.catalog, old.free_gpu_bytes, old.residents.keys(), old.pairs) != (
        new.catalog,
        new.free_gpu_bytes,
        new.residents.keys(),
        new.pairs,
    ):
        return True
    for key, seat in new.residents.items():
        was = old.residents[key]
        if abs(seat.last_used_s - was.last_used_s) > LAST_USED_SLACK_S:
            return True
        if replace(seat, last_used_s=was.last_used_s) != was:
            return True
    return False


async def _woken(wake: asyncio.Event, timeout_s: float) -> bool:
    """Waits for `wake` at most `timeout_s`. Returns whether it was set (and clears it)."""
    try:
        async with asyncio.timeout(timeout_s):
            await wake.wait()
    except TimeoutError:
        return False
    wake.clear()
    return True


class HugpyStoreLink(HugpyLink):
    """A hugpy box with `store` in its config: the store watch, else the API long-poll (rule 7)."""

    def __init__(self, box: BoxState) -> None:
        super().__init__(box)
        self.mode = "store watch"
        self._problem: str | None = None  # the last fallback reason logged

    async def follow_inventory(self) -> None:
        loop = asyncio.get_running_loop()
        path, name = self.box.config.store, self.box.name
        try:
            reader = await loop.run_in_executor(None, StoreReader, path, name)
        except StoreUnusable as exc:
            if str(exc) != self._problem:
                self._problem = str(exc)
                log.warning("box %s: store %s unusable, %s: following the API long-poll", name, path, exc)
            self.mode = HugpyLink.mode
            await super().follow_inventory()
            return
        self._problem = None
        self.mode = "store watch"
        log.info("box %s: watching store %s", name, path)
        try:
            await self._watch(reader)
        finally:
            reader.close()

    async def _watch(self, reader: StoreReader) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        fd = watch_directory(reader.path)
        prefix = os.fsencode(os.path.basename(reader.path))

        def on_event() -> None:
            if drain(fd, prefix):
                wake.set()

        if fd is not None:
            loop.add_reader(fd, on_event)
        interval = SAFETY_POLL_S if fd is not None else NO_INOTIFY_POLL_S
        published = parse_state(reader.first)
        self.publish(published)
        rechecks: tuple[float, ...] = ()  # the delays left before giving up on the last event
        try:
            while True:
                if await _woken(wake, rechecks[0] if rechecks else interval):
                    rechecks = RECHECK_DELAYS_S  # a new event restarts the schedule, checked now
                else:  # a recheck or the safety poll
                    rechecks = rechecks[1:]
                    if reader.replaced():
                        raise InventoryError("store file replaced or removed")
                try:
                    doc = reader.read_if_changed()
                except apsw.Error as exc:
                    raise InventoryError(f"store read failed: {exc}") from None
                if doc is None:
                    continue
                rechecks = ()
                inventory = parse_state(doc)
                if moved(published, inventory):
                    published = inventory
                    self.publish(inventory)
                await asyncio.sleep(MIN_READ_GAP_S)
        finally:
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
