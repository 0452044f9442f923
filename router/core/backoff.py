"""How a link that keeps failing waits between tries, and when it says so.

Every background link (a box's health and inventory, a `router agent` feed) runs one loop that
must never die: a box may be gone for a day and must be picked up again soon after it is back.

Rules:
1. The wait after the n-th failure in a row is `base_s * 2**(n-1)`, capped at `cap_s`, times a
   jitter factor in [0.5, 1) so that links that failed together do not retry in step. The
   exponent is clamped before it is raised, so no count of failures overflows a float (the
   old `0.25 * 2**failures` raised OverflowError at 1,024 failures and killed the link).
2. At least half the capped interval passes between tries, however long the outage: a link
   never spins on a box that refuses connections at once.
3. A success ends the streak: the next failure starts again from `base_s`.
4. A streak is logged when it starts and then at most once per `LOG_EVERY_S`, with its count,
   so a box down for a day writes a line a few times an hour, not one per try.
Nothing here reads a clock or draws a random number: `now_s` and `jitter` come in.
"""

from __future__ import annotations

BACKOFF_BASE_S = 0.25
# Five seconds: a box that comes back is read again within 5 s, well inside the 10 s health
# TTL the decision trusts, while a dead box costs one refused connect every 2.5-5 s per link,
# nothing a fleet of hundreds notices. (Envoy's health checker and gRPC's reconnect back-off
# cap higher, 30-120 s, for shared servers; a link here reads a box only this router uses.)
BACKOFF_CAP_S = 5.0
# A doubling from BACKOFF_BASE_S passes any sane cap long before this; clamping here keeps the
# power small whatever the failure count.
_MAX_EXPONENT = 32
LOG_EVERY_S = 600.0


def doubling_s(count: int, base_s: float, cap_s: float) -> float:
    """`base_s * 2**(count-1)` for `count` (>= 1) in a row, capped at `cap_s` (rule 1, before
    jitter); never raises for a large count. Also the refusal back-off's (router.core.admission)."""
    return min(cap_s, base_s * (1 << min(max(count - 1, 0), _MAX_EXPONENT)))


def backoff_s(failures: int, jitter: float, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """Seconds to wait after `failures` (>= 1) failures in a row; `jitter` is uniform in [0, 1).

    Returns a value in [cap/2, cap) once the cap is reached, and never raises for a large count.
    """
    return doubling_s(failures, base_s, cap_s) * (0.5 + 0.5 * jitter)


class Streak:
    """One link's run of failures (rules 1-4). Not thread-safe; one per link loop."""

    __slots__ = ("failures", "logged_at_s", "base_s", "cap_s")

    def __init__(self, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> None:
        self.failures = 0
        self.logged_at_s: float | None = None  # when this streak was last logged
        self.base_s = base_s
        self.cap_s = cap_s

    def failed(self, now_s: float, jitter: float) -> tuple[float, bool]:
        """Counts one failure at `now_s`. Returns (seconds to wait, whether to log it now)."""
        self.failures += 1
        log_now = self.logged_at_s is None or now_s - self.logged_at_s >= LOG_EVERY_S
        if log_now:
            self.logged_at_s = now_s
        return backoff_s(self.failures, jitter, self.base_s, self.cap_s), log_now

    def succeeded(self) -> int:
        """Ends the streak (rule 3). Returns how many failures it had: 0 when there was none."""
        failures, self.failures, self.logged_at_s = self.failures, 0, None
        return failures
