"""The boxes file: which boxes exist, how to reach them, and their keys.

Rules:
1. Location: `$HUGPY_ROUTER_BOXES`, else `<hugpy config dir>/router/boxes.json`, as 0.0.4
   (`router.store.paths`: `$HUGPY_CONFIG_DIR`, else `$XDG_CONFIG_HOME/hugpy` or
   `~/.config/hugpy`).
2. The file holds box keys, so it is written 0600, atomically (temp file in the same folder,
   fsync, rename): a reader never sees half a file.
3. Box names are unique. Every field passes router.core.box_fields (the one set of rules for the
   CLI, this file and the admin API), and a `store` must be a hugpy-wrapper store (rule 6).
   Order in the file is the boxes' stable order. A file with one bad entry is refused whole,
   with one line naming the file, the entry and why (the fleet's start exits 2 with it; a
   reload keeps the last good fleet).
4. A key file is read as hugpy-wrapper writes it: a `FITEVICT_TOKEN=` line (quotes allowed).
5. Every change (the CLI's `boxes add|remove|block|unblock` and `aliases set|remove`, the
   admin API's box and alias routes) is
   one `edit`: under an exclusive lock on `<file>.lock` (flock: other processes and other
   threads wait), read the file, change it, validate, write it (rule 2). So two edits at once
   never lose one, whoever makes them. A change that fails writes nothing. A path that is a
   symbolic link is followed first: the lock and the temp file live beside the real file (a
   system install links 0.0.4's path to the file in the router's own writable folder).
6. A store is a hugpy-wrapper store when it is a regular file (a symlink to one counts, as the
   store watch follows it) whose first 16 bytes are SQLite's header and whose schema has the
   wrapper's tables (`WRAPPER_TABLES`), read through a read-only SQLite connection. The header
   is read first, so a file that is not SQLite (`/etc/shadow`) is never opened as a database.
   An edit that sets a store needs the file now; a store named by the file being loaded may
   not exist yet (the wrapper creates it when it starts: its link follows the API until then,
   store_watch rule 7), but one that exists must pass.
7. Aliases live beside the boxes, in the same file (`"aliases": {name: [model, ...]}`), and
   are checked when read (router.core.aliases rule 1; router.boxes.aliases edits them).
8. Where the boxes and aliases live is a `Registry`: `load`, `edit` (rule 5's one edit), and a
   `stamp` that changes when they changed. `FileRegistry` is this file; several routers keep
   the same contents in PostgreSQL (router.boxes.pg_registry), parsed and validated by this
   module's `parse`, so every rule here holds there too, except that its `load` skips a bad
   entry (`skipped`, its line) where the file's refuses the file (router.boxes.fleet rule 4).
   `peers` are the routers whose listeners no box may name (router.boxes.listeners rule 4:
   none for the file, whose router checks its own). router.boxes.registry picks one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, TypeVar
from urllib.parse import urlsplit

import apsw
import orjson

from router.core import box_fields
from router.core.aliases import Alias, check_alias
from router.core.errors import ConfigError
from router.core.types import BoxKind
from router.store import paths
from router.store.files import write_atomically

T = TypeVar("T")
# What `PUT /v1/boxes/<name>`, `router boxes set` and `update` may change (the url: a new add).
UPDATABLE = ("pool", "kind", "store", "agent", "max_inflight", "key")

NAME_RE = box_fields.NAME_RE
MAX_INFLIGHT_LIMIT = box_fields.MAX_INFLIGHT_LIMIT
SQLITE_HEADER = b"SQLite format 3\x00"
# The tables the router reads from a wrapper store (router.boxes.hugpy.STATE_COLUMNS).
WRAPPER_TABLES = ("residents", "models", "gpu_state")
STORE_BUSY_TIMEOUT_MS = 1000
KEY_LINE_RE = re.compile(r"""^\s*(?:export\s+)?FITEVICT_TOKEN\s*=\s*["']?([^"'\s]+)["']?\s*$""")


@dataclass(frozen=True)
class BoxConfig:
    name: str
    url: str
    kind: BoxKind = BoxKind.HUGPY
    key: str | None = None
    store: str | None = None
    pool: str | None = None
    blocked: bool = False
    agent: str | None = None  # a `router agent` on the box's host: its GPU telemetry
    max_inflight: int | None = None  # calls at once, from every facade (None: no limit)

    @property
    def link_fields(self) -> tuple:
        """What the box's link is built from: a change here means a new link."""
        return (self.url, self.key, self.kind, self.store)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def to_json(self) -> dict:
        doc = {k: v for k, v in asdict(self).items() if v not in (None, False)}
        doc["kind"] = self.kind.value
        return doc


@dataclass
class BoxesFile:
    path: Path
    boxes: list[BoxConfig] = field(default_factory=list)
    aliases: dict[str, Alias] = field(default_factory=dict)  # rule 7, in the file's order
    skipped: list[str] = field(default_factory=list)  # entries left out, each its one line (rule 8)

    def find(self, name: str) -> BoxConfig | None:
        return next((box for box in self.boxes if box.name == name), None)

    def _index(self, name: str) -> int:
        for index, box in enumerate(self.boxes):
            if box.name == name:
                return index
        raise UnknownBox(name)

    def put(self, box: BoxConfig, *, replace: bool = True) -> bool:
        """Adds `box`, or replaces the box of that name in place. Returns True when added.
        Raises BoxExists when the name is taken and not `replace`, ConfigError when a field
        does not validate."""
        old = self.find(box.name)
        if old is not None and not replace:
            raise BoxExists(box.name)
        box = validate(box, new_store=old is None or old.store != box.store)
        if old is None:
            self.boxes.append(box)
            return True
        self.boxes[self._index(box.name)] = box
        return False

    def remove(self, name: str) -> BoxConfig:
        """Removes and returns the named box. Raises UnknownBox."""
        return self.boxes.pop(self._index(name))

    def update(self, name: str, /, **fields) -> BoxConfig:
        """Changes the named box's `UPDATABLE` fields (and `blocked`). Raises UnknownBox, or
        ConfigError for a field that may not change or a value that does not validate."""
        index = self._index(name)
        wrong = set(fields) - set(UPDATABLE) - {"blocked"}
        if wrong:
            raise ConfigError(f"box {name}: {', '.join(sorted(map(str, wrong)))[:200]} cannot be changed "
                              f"(only {', '.join(UPDATABLE)}; to change the url, add the box again with replace)")
        if "kind" in fields:
            fields["kind"] = kind_of(name, fields["kind"])
        old = self.boxes[index]
        new_store = "store" in fields and fields["store"] != old.store
        box = self.boxes[index] = validate(dataclasses.replace(old, **fields), new_store=new_store)
        return box


class UnknownBox(ConfigError):
    """No box of that name in the file."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no box named {name}")
        self.name = name


class BoxExists(ConfigError):
    """An add without replace names a box that is already in the file."""

    def __init__(self, name: str) -> None:
        super().__init__(f"box {name} is already in the boxes file")
        self.name = name


def kind_of(name: str, value: object) -> BoxKind:
    """The BoxKind named by `value`. Raises ConfigError naming the box `name`."""
    try:
        return BoxKind(value)
    except (ValueError, TypeError):
        raise ConfigError(f"box {name}: kind must be one of {', '.join(k.value for k in BoxKind)}") from None


def default_path() -> Path:
    """Returns the boxes file's path (rule 1)."""
    return paths.boxes_path()


def validate(box: BoxConfig, *, new_store: bool = False) -> BoxConfig:
    """Returns `box` when every field holds (router.core.box_fields, rule 6 for the store; an
    empty pool becomes none). `new_store`: this edit sets the store, so its file must exist.
    Raises ConfigError naming the box and the field."""
    _check_name(box.name)
    try:
        box_fields.check_url("url", box.url)
        if box.agent is not None:
            box_fields.check_url("agent", box.agent, box_fields.AGENT_SCHEMES)
        if not isinstance(box.kind, BoxKind):
            raise ConfigError(f"kind must be one of {', '.join(k.value for k in BoxKind)}")
        box_fields.check_key(box.key)
        pool = box_fields.check_pool(box.pool)
        box_fields.check_blocked(box.blocked)
        box_fields.check_max_inflight(box.max_inflight)
        if box_fields.check_store_path(box.store) is not None:
            check_store_file(box.store, must_exist=new_store)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"box {box.name}: {exc}") from None
    return box if pool == box.pool else dataclasses.replace(box, pool=pool)


def _check_name(name: str) -> None:
    try:
        box_fields.check_name(name)
    except ConfigError as exc:
        raise ConfigError(f"box {exc}") from None


def check_store_file(store: str, *, must_exist: bool) -> None:
    """Rule 6. Raises ConfigError saying what the file is not."""
    try:
        if not stat.S_ISREG(os.stat(store).st_mode):
            raise ConfigError(f"store {store} is not a regular file")
        # O_NONBLOCK: a file swapped for a FIFO after the stat cannot hang the open.
        fd = os.open(store, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"store {store} is not a regular file")
            head = os.read(fd, len(SQLITE_HEADER))
        finally:
            os.close(fd)
    except FileNotFoundError:
        if must_exist:
            raise ConfigError(f"store {store}: no such file (name the wrapper's fitevict.sqlite3 "
                              "on this machine)") from None
        return
    except OSError as exc:
        raise ConfigError(f"store {store} cannot be read: {exc.strerror}") from None
    if not head and not must_exist:
        return  # being created by the wrapper now
    if head != SQLITE_HEADER:
        raise ConfigError(f"store {store} is not a SQLite database")
    try:
        conn = apsw.Connection(store, flags=apsw.SQLITE_OPEN_READONLY)
        try:
            conn.set_busy_timeout(STORE_BUSY_TIMEOUT_MS)
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except apsw.Error as exc:
        raise ConfigError(f"store {store} cannot be read as SQLite: {type(exc).__name__}") from None
    missing = [t for t in WRAPPER_TABLES if t not in tables]
    if missing:
        raise ConfigError(f"store {store} is not a hugpy-wrapper store (no {', '.join(missing)} table)")


def parse(doc: object, path: Path, where: str | None = None, skip_bad: bool = False) -> BoxesFile:
    """The boxes in `doc`, every entry validated (rule 3). Raises ConfigError with one line:
    `where` (default: the file at `path`), the entry (its position from 1 and its name) and why.
    `skip_bad` (a registry that several routers share, rule 8): a bad entry is left out and its
    line kept in `skipped` instead."""
    where = where or f"boxes file {path}"
    if not isinstance(doc, dict) or not isinstance(doc.get("boxes", []), list):
        raise ConfigError(f"{where}: expected an object with a 'boxes' list")
    boxes: list[BoxConfig] = []
    skipped: list[str] = []
    for number, entry in enumerate(doc.get("boxes", []), 1):
        try:
            boxes.append(_entry(entry, boxes))
        except ConfigError as exc:
            if not skip_bad:
                raise ConfigError(f"{where}, entry {number}: {exc}") from None
            skipped.append(f"{where}, entry {number}: {exc}")
    return BoxesFile(path, boxes, parse_aliases(doc.get("aliases", {}), where), skipped)


def parse_aliases(doc: object, where: str) -> dict[str, Alias]:
    """The file's aliases (rule 7). Raises ConfigError naming the first bad one."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: 'aliases' must be an object of name: [model, ...]")
    aliases: dict[str, Alias] = {}
    for name, chain in doc.items():
        wrong = check_alias(name, chain, doc, lambda model: False)
        if wrong is not None:
            raise ConfigError(f"{where}: {wrong}")
        aliases[name] = Alias(name, tuple(chain))
    return aliases


def _entry(entry: object, before: list[BoxConfig]) -> BoxConfig:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ConfigError("every box needs a string 'name'")
    name = entry["name"]
    _check_name(name)  # first: the messages below name the box (a newline would forge a log line)
    url = entry.get("url", "")
    box = BoxConfig(
        name=name,
        url=url.rstrip("/") if isinstance(url, str) else url,
        kind=kind_of(name, entry.get("kind", BoxKind.HUGPY.value)),
        key=entry.get("key"),
        store=entry.get("store"),
        pool=entry.get("pool"),
        blocked=entry.get("blocked", False),
        agent=entry.get("agent"),
        max_inflight=entry.get("max_inflight"),
    )
    if any(b.name == box.name for b in before):
        raise ConfigError(f"box name {box.name!r} appears twice")
    return validate(box)


def load(path: Path | None = None) -> BoxesFile:
    """Reads the boxes file; a missing file is an empty fleet. Raises ConfigError."""
    path = path or default_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return BoxesFile(path, [])
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"boxes file {path} is not valid JSON: {exc.msg}") from None
    return parse(doc, path)


def save(boxes: BoxesFile) -> None:
    """Writes the file atomically with mode 0600."""
    path = boxes.path
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = {"boxes": [b.to_json() for b in boxes.boxes]}
    if boxes.aliases:
        doc["aliases"] = {alias.name: list(alias.chain) for alias in boxes.aliases.values()}
    write_atomically(path, orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n", 0o600)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds the exclusive lock of the boxes file at `path` (rule 5)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def edit(path: Path | None, change: Callable[[BoxesFile], T]) -> T:
    """Reads the file under its lock, applies `change` to it and writes it (rule 5). Returns
    what `change` returns. Raises ConfigError (UnknownBox included) with nothing written."""
    path = Path(os.path.realpath(path or default_path()))
    with locked(path):
        boxes = load(path)
        result = change(boxes)
        save(boxes)
    return result


def read_key_file(path: str) -> str:
    """The box key from a hugpy-wrapper env file. Raises ConfigError when there is none."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None
    for line in text.splitlines():
        match = KEY_LINE_RE.match(line)
        if match:
            return match.group(1)
    raise ConfigError(f"{path} has no FITEVICT_TOKEN= line")


class RegistryDown(OSError):
    """The registry cannot be reached now (a database down): not the edit's fault."""


class Registry(Protocol):
    """Where the boxes and aliases live (rule 8)."""

    where: str  # shown in messages: the file's path, or the database

    def load(self) -> BoxesFile:
        """The boxes and aliases, validated. Raises ConfigError."""

    def edit(self, change: Callable[[BoxesFile], T]) -> T:
        """Rule 5's one edit. Raises ConfigError, with nothing written; OSError when the
        registry cannot be written now."""

    def stamp(self) -> object:
        """Changes when the contents changed (None: there are none)."""

    def peers(self) -> list:
        """The routers sharing this registry (router.boxes.listeners.Peer). Raises OSError."""

    def announce(self, peer) -> None:
        """Tells the other routers this one's listeners (a Peer). Raises OSError."""

    def withdraw(self, instance: str) -> None:
        """Takes back what `announce` told. Raises OSError."""


class FileRegistry:
    """The boxes file as the Registry (rules 1-7)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = f"boxes file {path}"

    def load(self) -> BoxesFile:
        return load(self.path)

    def edit(self, change: Callable[[BoxesFile], T]) -> T:
        return edit(self.path, change)

    def stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def peers(self) -> list:
        return []  # one router per file: its own listeners are its `Listening`

    def announce(self, peer) -> None:
        pass  # the record beside the file is the CLI's (router.boxes.listeners rule 2)

    def withdraw(self, instance: str) -> None:
        pass
