"""The router's API keys: minted, listed and revoked in the store; checked from memory.

The scheme is hugpy-wrapper's (contracts/hugpy-wrapper.md §6; the parsing and hashing rules
live in `router.core.access`).

Rules:
1. `create` mints `id = token_hex(5)` and `secret = token_urlsafe(32)`; the key is
   `hpk_<id>_<secret>`. Only `sha256(secret)` is stored. The full key is returned once and is
   never stored or logged.
2. `scope_of` does no I/O and takes no lock: it reads an in-memory map
   id -> (scope, secret_hash, expires_at, revoked_at). The map is replaced whole, never changed
   in place, so the event loop always reads one consistent version.
3. A key valid for `scope_of`: `admin_key` (`HUGPY_ROUTER_KEY`) when equal gives `admin`;
   otherwise the key must parse, its row exist, not be revoked, not be expired
   (`expires_at < now` is expired), and its secret's hash match. The answer is the row's
   scope; anything else is None. Both comparisons run in constant time.
4. The map is reloaded after `create` and `revoke` on this KeyStore, and by
   `refresh_if_changed()` when the engine's version says another connection committed
   (SQLite's `PRAGMA data_version`: a `router keys` command in another process; also the
   route_log writer, a harmless false alarm costing one small SELECT). It looks at most once
   per `REFRESH_EVERY_S`. A SQLite error while reloading empties the map: a store error counts
   as an invalid key (fails closed). A PostgreSQL engine keeps the last map instead (issue 23:
   an outage of the shared database must not stop calls; router.store.pg.keys).
5. `last_used_at` is lazy: `scope_of` notes id -> now in memory; `flush_last_used(now)` writes
   a key's last use when it is newer than what was written and `LAST_USED_EVERY_S` have passed
   since this process last wrote that key. `list()` shows the newer of stored and noted.
6. All store work (`create`, `list`, `revoke`, `refresh_if_changed`, `flush_last_used`,
   `set_limits`, `usage`) is serialised by one lock and belongs off the event loop. It goes
   through a `KeyEngine` (SQLite's `SqliteKeys` here, PostgreSQL's in router.store.pg.keys):
   the SQL is this module's, written with `?` parameters; an engine runs it.
7. A key's limits (router.core.limits) are columns of its row, read into the map with it:
   `limits_of` reads them from memory, so a change through this KeyStore (the admin API) holds
   from the next call, and one by another process (`router keys limits`) within a second
   (rule 4). Bad limits raise BadRequest and change nothing.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import apsw

from router.core.access import KEY_PREFIX, hash_secret, parse_key
from router.core.admission import Priority
from router.core.errors import BadRequest
from router.core.limits import NO_LIMITS, Limits, parse_limits, period_bounds, previous_period
from router.store import db

log = logging.getLogger(__name__)

SCOPES = ("use", "admin")
PRIORITIES = tuple(p.name.lower() for p in Priority)
# A revoked key must stop working soon, and a key made by `router keys create` in another
# process must start working soon; once a second is "soon" at the cost of one PRAGMA.
REFRESH_EVERY_S = 1.0
# hugpy-wrapper writes last_used_at at most once per 60 s per key: a busy key must not turn
# every call into a store write.
LAST_USED_EVERY_S = 60.0
# 40-bit ids collide about once in a million mints at a thousand keys; three tries make a
# failed create practically impossible without hiding a real constraint error.
ID_ATTEMPTS = 3
NAME_MAX = 200
# A century: any longer is a typo, and the sum with the clock must stay a plain float.
EXPIRES_DAYS_MAX = 36_500
LIST_COLUMNS = ("id", "name", "scope", "priority", "created_at", "created_by", "expires_at", "last_used_at", "revoked_at")
LIMIT_COLUMNS = ("rpm", "tpm", "max_parallel", "budget_tokens", "budget_period", "models")
SECONDS_PER_DAY = 86_400
USAGE_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "estimated")


class KeyRow(NamedTuple):
    scope: str
    secret_hash: str
    expires_at: float | None
    revoked_at: float | None
    priority: Priority
    limits: Limits = NO_LIMITS


def _in_force(row: KeyRow, now: float) -> bool:
    """Neither revoked nor expired (`expires_at < now` is expired: rule 3)."""
    return row.revoked_at is None and (row.expires_at is None or row.expires_at >= now)


def _limits_of(rpm, tpm, max_parallel, budget_tokens, budget_period, models) -> Limits:
    """A row's limit columns as Limits (the store's CHECKs keep them valid)."""
    if rpm is None and tpm is None and max_parallel is None and budget_tokens is None and models is None:
        return NO_LIMITS
    return Limits(rpm, tpm, max_parallel, budget_tokens, budget_period or "day",
                  frozenset(json.loads(models)) if models is not None else None)


def _limit_values(limits: Limits) -> tuple:
    return (limits.rpm, limits.tpm, limits.max_parallel, limits.budget_tokens, limits.budget_period,
            json.dumps(sorted(limits.models)) if limits.models is not None else None)


def _priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise BadRequest(f"priority must be one of {', '.join(PRIORITIES)}", code="invalid_priority")
    return priority


def _validate(name: str, scope: str, expires_days: float | None) -> str:
    name = name.strip()
    if not name or len(name) > NAME_MAX:
        raise BadRequest(f"a key name must be 1-{NAME_MAX} characters", code="invalid_name")
    if not name.isprintable():
        # Control characters (NUL, CR/LF, ESC) and format ones (the bidi overrides, U+202E) would
        # forge lines or reorder text wherever a name is shown: a terminal, a log, the dashboard.
        raise BadRequest("a key name must be printable: no control, NUL or bidi characters",
                         code="invalid_name")
    if scope not in SCOPES:
        raise BadRequest(f"scope must be one of {', '.join(SCOPES)}", code="invalid_scope")
    if expires_days is not None and not (math.isfinite(expires_days) and 0 < expires_days <= EXPIRES_DAYS_MAX):
        raise BadRequest(f"expires_days must be a number above 0 and at most {EXPIRES_DAYS_MAX}", code="invalid_expiry")
    return name


class KeyEngine(Protocol):
    """Runs KeyStore's SQL (`?` parameters) on one engine (rule 6)."""

    errors: tuple[type[BaseException], ...]  # what a failed statement raises
    duplicate: type[BaseException]  # what an INSERT of a taken id raises
    keep_on_error: bool  # an unreadable store keeps the last map (True) or empties it (rule 4)

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]: ...

    def run(self, sql: str, params: tuple = ()) -> int:
        """Runs one change; returns the rows it changed."""

    def run_many(self, sql: str, rows: list[tuple]) -> None:
        """Runs one change per row, all in one transaction."""

    def version(self) -> object:
        """Changes when another connection committed a change to the keys (rule 4)."""

    def close(self) -> None: ...


class SqliteKeys:
    """KeyStore's engine on the SQLite store."""

    errors = (apsw.Error,)
    duplicate = apsw.ConstraintError
    keep_on_error = False

    def __init__(self, path: Path) -> None:
        self._conn = db.open_store(path)

    def fetch(self, sql: str, params: tuple = ()) -> list[tuple]:
        return list(self._conn.execute(sql, params))

    def run(self, sql: str, params: tuple = ()) -> int:
        self._conn.execute(sql, params)
        return self._conn.changes()

    def run_many(self, sql: str, rows: list[tuple]) -> None:
        with db.immediate(self._conn) as conn:
            conn.executemany(sql, rows)

    def version(self) -> object:
        return self._conn.pragma("data_version")

    def close(self) -> None:
        self._conn.close()


class KeyStore:
    """API keys in the store, checked from memory (rules 1-7)."""

    def __init__(self, db_path: Path | str, engine: KeyEngine | None = None) -> None:
        """Opens (checks, migrates) the store and loads the keys: the SQLite file at `db_path`,
        or `engine` when given (`db_path` then only names the router's folder). Raises
        ConfigError."""
        self.path = Path(db_path)
        self._lock = threading.Lock()
        self._db: KeyEngine = engine if engine is not None else SqliteKeys(self.path)
        # The map scope_of reads (rule 2) and the data_version it was loaded at (rule 4).
        self._rows: dict[str, KeyRow] = {}
        self._data_version: object = None
        self._checked_mono = -math.inf
        self._unread_since: float | None = None  # when the store stopped reading (keep_on_error)
        # Rule 5: id -> last use noted by scope_of; id -> (when written, value written).
        self._used: dict[str, float] = {}
        self._flushed: dict[str, tuple[float, float]] = {}
        self._reload()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """What a store error raises here (the engine's)."""
        return self._db.errors

    # --- the hot path ---------------------------------------------------------------------

    def scope_of(self, bearer: str, now: float, admin_key: str | None) -> str | None:
        """Returns "use", "admin" or None for a presented key (rule 3). No I/O."""
        held = self.holder(bearer, now, admin_key)
        return held[1] if held is not None else None

    def holder(self, bearer: str, now: float, admin_key: str | None) -> tuple[str, str] | None:
        """Returns (key id, scope) for a valid presented key (rule 3; `admin_key` is id
        "admin"), None for anything else. No I/O."""
        try:
            if admin_key and hmac.compare_digest(
                bearer.encode("utf-8", "surrogatepass"), admin_key.encode("utf-8", "surrogatepass")
            ):
                return "admin", "admin"
            parsed = parse_key(bearer)
            if parsed is None:
                return None
            key_id, secret = parsed
            row = self._rows.get(key_id)
            if row is None or not _in_force(row, now):
                return None
            if not hmac.compare_digest(hash_secret(secret), row.secret_hash):
                return None
        except UnicodeEncodeError:  # a lone surrogate from a mis-decoded header: not a key
            return None
        self._used[key_id] = now
        return key_id, row.scope

    # --- off the event loop ---------------------------------------------------------------

    def refresh_if_changed(self) -> bool:
        """Reloads the map when another connection committed since the last load, looking at
        most once per REFRESH_EVERY_S (rule 4). Returns True when it reloaded."""
        now = time.monotonic()
        if now - self._checked_mono < REFRESH_EVERY_S:
            return False
        self._checked_mono = now
        try:
            with self._lock:
                changed = self._db.version() != self._data_version
        except self._db.errors as exc:
            self._unreadable(exc)
            return True
        if changed:
            self._reload()
        return changed

    def flush_last_used(self, now: float) -> int:
        """Writes noted uses to `last_used_at` (rule 5). Returns how many keys it wrote."""
        due = []
        for key_id, used in list(self._used.items()):  # a copy: scope_of adds while we read
            written_at, written = self._flushed.get(key_id, (-math.inf, -math.inf))
            if used > written and now - written_at >= LAST_USED_EVERY_S:
                due.append((key_id, used))
        if not due:
            return 0
        try:
            with self._lock:
                self._db.run_many(
                    "UPDATE api_keys SET last_used_at = ? WHERE id = ? "
                    "AND (last_used_at IS NULL OR last_used_at < ?)",
                    [(used, key_id, used) for key_id, used in due],
                )
        except self._db.errors as exc:
            log.warning("api_keys: last_used_at not written (%s); will retry", exc)
            return 0
        for key_id, used in due:
            self._flushed[key_id] = (now, used)
        return len(due)

    def priority_of(self, key_id: str) -> Priority:
        """The class a key's calls wait in (normal for an unknown id). No I/O."""
        row = self._rows.get(key_id)
        return row.priority if row is not None else Priority.NORMAL

    def ended(self, key_id: str, now: float) -> bool:
        """The key of id `key_id` is known and revoked or expired (rule 3): work it started (a
        batch's lines) stops. An id not in the map is not said to have ended: the map may not hold
        a key made a moment ago elsewhere, or may be empty after a store error. No I/O."""
        row = self._rows.get(key_id)
        return row is not None and not _in_force(row, now)

    def budgets(self) -> dict[str, Limits]:
        """The limits of every key with a budget, by id. No I/O."""
        return {key_id: row.limits for key_id, row in self._rows.items() if row.limits.budget_tokens is not None}

    def limits_of(self, key_id: str) -> Limits:
        """A key's limits (rule 7; none for an unknown id). No I/O."""
        row = self._rows.get(key_id)
        return row.limits if row is not None else NO_LIMITS

    def create(
        self, name: str, scope: str, expires_days: float | None = None, created_by: str | None = None,
        priority: str = "normal", limits: dict | None = None,
    ) -> tuple[str, str]:
        """Mints a key (rule 1). Returns (id, full key); the full key is not retrievable later.

        Raises BadRequest for an empty or long name, an unknown scope or priority, or a
        non-positive expiry.
        """
        name = _validate(name, scope, expires_days)
        priority = _priority(priority)
        limited = _limit_values(parse_limits(limits or {}))
        now = time.time()
        expires_at = None if expires_days is None else now + expires_days * SECONDS_PER_DAY
        for attempt in range(ID_ATTEMPTS):
            key_id, secret = secrets.token_hex(5), secrets.token_urlsafe(32)
            try:
                with self._lock:
                    self._db.run(
                        "INSERT INTO api_keys (id, name, scope, secret_hash, created_at, created_by,"
                        f" expires_at, priority, {', '.join(LIMIT_COLUMNS)})"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (key_id, name, scope, hash_secret(secret), now, created_by, expires_at, priority,
                         *limited),
                    )
                break
            except self._db.duplicate:  # an id collision (rule 1's 40 bits); try another
                if attempt == ID_ATTEMPTS - 1:
                    raise
        self._reload()
        return key_id, f"{KEY_PREFIX}{key_id}_{secret}"

    def list(self, include_revoked: bool = False) -> list[dict[str, Any]]:
        """Returns the keys (never their hashes) with their `limits`, oldest first; revoked ones
        only on request."""
        sql = f"SELECT {', '.join(LIST_COLUMNS + LIMIT_COLUMNS)} FROM api_keys"
        if not include_revoked:
            sql += " WHERE revoked_at IS NULL"
        with self._lock:
            found = self._db.fetch(sql + " ORDER BY created_at, id")
        split = len(LIST_COLUMNS)
        rows = [{**dict(zip(LIST_COLUMNS, row[:split])), "limits": _limits_of(*row[split:]).doc()} for row in found]
        for row in rows:
            noted = self._used.get(row["id"])
            if noted is not None and (row["last_used_at"] is None or noted > row["last_used_at"]):
                row["last_used_at"] = noted
        return rows

    def set_priority(self, key_id: str, priority: str) -> bool:
        """Changes a key's class. Returns False when no key has that id. Raises BadRequest."""
        priority = _priority(priority)
        with self._lock:
            found = self._db.run("UPDATE api_keys SET priority = ? WHERE id = ?", (priority, key_id)) > 0
        if found:
            self._reload()
        return found

    def set_limits(self, key_id: str, changes: dict) -> Limits | None:
        """Changes a key's limits (`changes` as router.core.limits.parse_limits takes them: an
        absent field kept, null removed). Returns the new limits, None when no key has that id.
        Raises BadRequest, changing nothing (rule 7)."""
        with self._lock:
            found = self._db.fetch(f"SELECT {', '.join(LIMIT_COLUMNS)} FROM api_keys WHERE id = ?", (key_id,))
        if not found:
            return None
        limits = parse_limits(changes, _limits_of(*found[0]))
        with self._lock:
            self._db.run(
                f"UPDATE api_keys SET {', '.join(f'{c} = ?' for c in LIMIT_COLUMNS)} WHERE id = ?",
                (*_limit_values(limits), key_id),
            )
        self._reload()
        return limits

    def usage(self, key_id: str, start: float, end: float) -> dict[str, int]:
        """A key's calls and tokens in [start, end) (UTC day bounds), from `key_usage`."""
        with self._lock:
            (found,) = self._db.fetch(
                f"SELECT {', '.join(f'coalesce(sum({c}), 0)' for c in USAGE_SUMS)} FROM key_usage"
                " WHERE key_id = ? AND day >= ? AND day < ?",
                (key_id, int(start // SECONDS_PER_DAY), int(end // SECONDS_PER_DAY)),
            )
        return {name: int(value) for name, value in zip(USAGE_SUMS, found)}

    def usage_report(self, key_ids: list[str] | None, now: float) -> list[dict[str, Any]]:
        """Each key's (every live key's, for None) limits and usage in its current and previous
        period (its budget's, else the UTC day), from `key_usage`."""
        docs = []
        for row in self.list(include_revoked=key_ids is not None):
            key_id = row["id"]
            if key_ids is not None and key_id not in key_ids:
                continue
            limits = self.limits_of(key_id)
            current = period_bounds(limits.budget_period, now)
            previous = previous_period(limits.budget_period, now)
            docs.append({
                "id": key_id, "name": row["name"], "limits": limits.doc(), "period": limits.budget_period,
                "current": {"start": current[0], "end": current[1], **self.usage(key_id, *current)},
                "previous": {"start": previous[0], "end": previous[1], **self.usage(key_id, *previous)},
            })
        return docs

    def revoke(self, key_id: str) -> bool:
        """Revokes a key (again: a no-op keeping the first time). Returns False when no key
        has that id."""
        with self._lock:
            found = self._db.run(
                "UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?",
                (time.time(), key_id),
            ) > 0
        if found:
            self._reload()
        return found

    def reload(self) -> None:
        """Reloads the map now, whatever `data_version` says (a SIGHUP)."""
        self._reload()

    # --- the map --------------------------------------------------------------------------

    def _reload(self) -> None:
        try:
            with self._lock:
                # The version first: a commit landing between the two is seen next time.
                version = self._db.version()
                rows = {
                    key_id: KeyRow(scope, secret_hash, expires_at, revoked_at, Priority[priority.upper()],
                                   _limits_of(*limited))
                    for key_id, scope, secret_hash, expires_at, revoked_at, priority, *limited in self._db.fetch(
                        "SELECT id, scope, secret_hash, expires_at, revoked_at, priority,"
                        f" {', '.join(LIMIT_COLUMNS)} FROM api_keys"
                    )
                }
        except self._db.errors as exc:
            self._unreadable(exc)
            return
        if self._unread_since is not None:
            log.warning("api_keys: store readable again; keys reloaded")
            self._unread_since = None
        self._rows = rows
        self._data_version = version

    def _unreadable(self, exc: BaseException) -> None:
        """Rule 4: SQLite fails closed; an engine that keeps its map serves the last copy (said
        once per outage)."""
        if self._db.keep_on_error:
            if self._unread_since is None:
                self._unread_since = time.monotonic()
                log.warning("api_keys: store unreadable (%s); serving the last %d keys loaded until it "
                            "reads again", type(exc).__name__, len(self._rows))
            self._data_version = None  # read again at the next look
            return
        log.warning("api_keys: store unreadable (%s); every key is invalid until it reads again", exc)
        self._rows = {}
        self._data_version = None
