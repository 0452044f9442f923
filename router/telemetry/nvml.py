"""This host's GPUs through NVML (the `nvidia-ml-py` distribution, module `pynvml`).

Rules (contracts/stack-notes.md §5):
1. Every NVML call blocks in C: `Scanner.scan` is meant to run in a thread
   (`loop.run_in_executor`) at about 1 Hz, never on the event loop and never per call.
2. `nvmlInit` succeeds once per process; the card handles and UUIDs are read then and kept.
   Until it succeeds, each scan tries again (a driver may load after the router starts) and
   raises `NvmlUnavailable`: no library (LibraryNotFound), no driver (DriverNotLoaded), no
   access (NoPermission), or any other init error. That is a normal state, not a crash.
3. After init, a card whose utilisation or memory call fails (NotSupported on some boards,
   GpuIsLost) reports None for those fields; the other cards still count.
4. A host with NVML but no GPU scans to an empty list.
5. The one seam for tests is `Scanner(backend=...)`: any callable returning card readings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pynvml

from router.core.pressure import Reading, valid_util


class NvmlUnavailable(Exception):
    """NVML cannot be used on this host; `str(exc)` says why. Telemetry then comes from elsewhere."""


@dataclass(frozen=True, slots=True)
class CardReading:
    """One card at one scan. `util_pct` is the share of the driver's last sample period busy."""

    index: int
    uuid: str
    util_pct: float | None
    mem_free_bytes: int | None
    mem_total_bytes: int | None


class PynvmlBackend:
    """The real scan. Thread-safe: a lock serialises init and scans (rule 2)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cards: list[tuple[object, str]] | None = None  # (handle, uuid) per index, after init

    def __call__(self) -> list[CardReading]:
        with self._lock:
            if self._cards is None:
                self._cards = _init()
            return [_read_card(index, handle, uuid) for index, (handle, uuid) in enumerate(self._cards)]


def _init() -> list[tuple[object, str]]:
    """Raises NvmlUnavailable (rule 2)."""
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        # nvidia-ml-py >= 12 returns str; older releases returned bytes.
        uuids = [_text(pynvml.nvmlDeviceGetUUID(handle)) for handle in handles]
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from None
    return list(zip(handles, uuids))


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def _read_card(index: int, handle: object, uuid: str) -> CardReading:
    """Rule 3: a failing call leaves its fields None."""
    try:
        util_pct: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        util_pct = None
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        free, total = int(memory.free), int(memory.total)
    except pynvml.NVMLError:
        free = total = None
    return CardReading(index, uuid, util_pct, free, total)


class Scanner:
    """Scans this host's cards; `backend` replaces NVML in tests (rule 5)."""

    def __init__(self, backend: Callable[[], list[CardReading]] | None = None) -> None:
        self._backend = backend if backend is not None else PynvmlBackend()

    def scan(self) -> list[CardReading]:
        """Every card now, in index order. Blocking (rule 1).

        Raises NvmlUnavailable when NVML cannot be used on this host.
        """
        return self._backend()


def reduce_cards(cards: Sequence[CardReading], read_at_s: float, source: str) -> Reading:
    """One compact reading for the host: the maximum valid utilisation over its cards, memory
    free and total summed over the cards that report them; None where no card reports a value
    (so no card at all gives the neutral pressure)."""
    utils = [card.util_pct for card in cards if valid_util(card.util_pct)]
    frees = [card.mem_free_bytes for card in cards if card.mem_free_bytes is not None]
    totals = [card.mem_total_bytes for card in cards if card.mem_total_bytes is not None]
    return Reading(
        util_pct=max(utils) if utils else None,
        mem_free_bytes=sum(frees) if frees else None,
        mem_total_bytes=sum(totals) if totals else None,
        read_at_s=read_at_s,
        source=source,
    )
