"""Opening the store: one SQLite file through APSW, checked and migrated at start.

Rules:
1. `connect` creates a missing folder and a missing file before SQLite opens it, with the
   modes of `paths.store_modes()` (private: 0700 and 0600); SQLite gives the `-wal` and
   `-shm` files the database file's mode. In private mode existing folders and files keep the
   mode their owner gave them. In group mode `open_store` sets the folder, the file, `-wal`
   and `-shm` to the group modes and group at every start, as hugpy-wrapper and 0.0.4 do
   (best effort: a file this process may not change is left as it is).
2. Every connection runs in WAL mode with `synchronous=NORMAL` (a commit survives a killed
   process; only an OS crash can lose the last commits) and a busy timeout, so the route_log
   writer, the key store and a `router keys` command in another process wait for each other
   instead of failing.
3. `open_store` runs `PRAGMA integrity_check` before anything else touches the file. A corrupt
   file raises ConfigError and is left exactly as found: the router never recreates a store
   silently (hugpy-wrapper renames and recreates; here the operator decides).
4. Migrations are `schema/NNNN_name.sql`, numbered 1..N without gaps, each applied in its own
   `BEGIN IMMEDIATE` transaction together with `PRAGMA user_version = NNNN`, so
   `user_version` is always the number of the last migration applied. The version is read
   again inside the transaction, so two processes starting at once apply each step once.
   A file newer than this code (a larger `user_version`) raises ConfigError.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import re
from pathlib import Path
from typing import Iterator

import apsw

from router.core.errors import ConfigError, UsageError
from router.store import paths

# hugpy-wrapper's store waits 10 s (store.py:220-228); a writer batch or a key change holds
# the lock for milliseconds, so 10 s only runs out when something is wrong.
BUSY_TIMEOUT_MS = 10_000
# Enough lines of `integrity_check` output to tell the operator what is wrong, not a page.
INTEGRITY_LINES = 5
MIGRATION_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


def _ensure_file(path: Path, modes: paths.StoreModes) -> None:
    """Creates the folder and an empty file with `modes` when missing (rule 1)."""
    folder = path.parent
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, modes.folder)  # mkdir's mode is filtered by the umask; make it exact
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, modes.file)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, modes.file)
    finally:
        os.close(fd)


def share(path: Path, modes: paths.StoreModes) -> None:
    """Gives the folder, the file, `-wal` and `-shm` the group modes and group (rule 1)."""
    gid = -1
    try:
        import grp

        gid = grp.getgrnam(modes.group).gr_gid if modes.group else -1
    except KeyError:
        pass
    for target, mode in ((path.parent, modes.folder), (path, modes.file),
                         (Path(f"{path}-wal"), modes.file), (Path(f"{path}-shm"), modes.shm)):
        try:
            os.chmod(target, mode)
            if gid != -1:
                os.chown(target, -1, gid)
        except OSError:  # missing (-wal, -shm), or not ours to change
            pass


def connect(path: Path | str) -> apsw.Connection:
    """Returns a connection with the rule-2 settings; no check, no migration.

    Raises ConfigError when the file cannot be opened or is not a database.
    """
    path = Path(path)
    try:
        _ensure_file(path, paths.store_modes())
    except OSError as exc:
        raise ConfigError(f"cannot create store {path}: {exc.strerror or exc}") from exc
    conn = None
    try:
        conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE)
        conn.set_busy_timeout(BUSY_TIMEOUT_MS)
        conn.pragma("journal_mode", "wal")
        conn.pragma("synchronous", "normal")
    except (apsw.CorruptError, apsw.NotADBError) as exc:
        if conn is not None:
            conn.close()
        raise _corrupt(path, str(exc)) from exc
    except apsw.Error as exc:
        if conn is not None:
            conn.close()
        raise ConfigError(f"cannot open store {path}: {exc}") from exc
    return conn


def _corrupt(path: Path, detail: str) -> ConfigError:
    return ConfigError(
        f"store {path} is corrupt ({detail}); the router will not recreate it: move the file "
        "aside (with its -wal and -shm) or restore a backup, then start again"
    )


def check(conn: apsw.Connection, path: Path | str) -> None:
    """Runs `PRAGMA integrity_check` (rule 3). Raises ConfigError when it reports anything
    but `ok`, or when SQLite finds the file corrupt while checking."""
    try:
        lines = [row[0] for row in conn.execute(f"PRAGMA integrity_check({INTEGRITY_LINES})")]
    except (apsw.CorruptError, apsw.NotADBError) as exc:
        raise _corrupt(Path(path), str(exc)) from exc
    except apsw.Error as exc:
        raise ConfigError(f"cannot check store {path}: {exc}") from exc
    if lines != ["ok"]:
        raise _corrupt(Path(path), "; ".join(lines))


@contextlib.contextmanager
def immediate(conn: apsw.Connection) -> Iterator[apsw.Connection]:
    """One write transaction: BEGIN IMMEDIATE, committed when the block ends, rolled back when it
    raises. IMMEDIATE takes the write lock up front, so a busy store waits in the busy handler
    (rule 2) instead of failing halfway through."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def migrations(package: str = "router.store", what: str = "store") -> list[tuple[int, str, str]]:
    """Returns (version, name, sql) for every migration shipped in `package`'s `schema` folder,
    in order (rule 4; router.store.pg keeps PostgreSQL's in its own).

    Raises UsageError when the files are misnumbered: a packaging bug, not a user's error.
    """
    folder = importlib.resources.files(package) / "schema"
    steps = []
    for entry in folder.iterdir():
        match = MIGRATION_RE.fullmatch(entry.name)
        if match is not None:
            steps.append((int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    steps.sort()
    if [version for version, _, _ in steps] != list(range(1, len(steps) + 1)):
        raise UsageError(f"{what} migrations must be numbered 1..N: {[s[:2] for s in steps]}")
    return steps


def migrate(conn: apsw.Connection) -> int:
    """Applies the migrations the file lacks (rule 4). Returns the schema version.

    Raises ConfigError when the file is newer than this code or a migration fails.
    """
    steps = migrations()
    latest = steps[-1][0] if steps else 0
    current = conn.pragma("user_version")
    if current > latest:
        raise ConfigError(
            f"store schema version {current} is newer than this router knows ({latest}); "
            "upgrade the router"
        )
    for version, name, sql in steps:
        if version <= current:
            continue
        try:
            with immediate(conn):
                if conn.pragma("user_version") < version:  # another process may have won
                    conn.execute(sql).fetchall()
                    conn.pragma("user_version", version)
        except apsw.Error as exc:
            raise ConfigError(f"store migration {version:04d}_{name} failed: {exc}") from exc
        current = version
    return conn.pragma("user_version")


def open_store(path: Path | str) -> apsw.Connection:
    """Returns a connection to a checked, migrated store (rules 1-4).

    Raises ConfigError when the file cannot be opened, is corrupt, or cannot be migrated.
    """
    conn = connect(path)
    try:
        check(conn, path)
        migrate(conn)
    except BaseException:
        conn.close()
        raise
    modes = paths.store_modes()
    if modes.group is not None:
        share(Path(path), modes)
    return conn
