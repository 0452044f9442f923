"""The boxes file: which boxes exist, how to reach them, and their keys.

Rules:
1. Location: `$HUGPY_ROUTER_BOXES`, else `<hugpy config dir>/router/boxes.json`, as 0.0.4
   (`router.store.paths`: `$HUGPY_CONFIG_DIR`, else `$XDG_CONFIG_HOME/hugpy` or
   `~/.config/hugpy`).
2. The file holds box keys, so it is written 0600, atomically (temp file in the same folder,
   fsync, rename): a reader never sees half a file.
3. Box names are unique and match the hugpy request-id alphabet, so that they can travel in
   headers and URLs as they are. Order in the file is the boxes' stable order.
4. A key file is read as hugpy-wrapper writes it: a `FITEVICT_TOKEN=` line (quotes allowed).
5. Every change (the CLI's `boxes add|remove|block|unblock`, the admin API's box routes) is
   one `edit`: under an exclusive lock on `<file>.lock` (flock: other processes and other
   threads wait), read the file, change it, validate, write it (rule 2). So two edits at once
   never lose one, whoever makes them. A change that fails writes nothing. A path that is a
   symbolic link is followed first: the lock and the temp file live beside the real file (a
   system install links 0.0.4's path to the file in the router's own writable folder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit

import orjson

from router.core.errors import ConfigError
from router.core.types import BoxKind
from router.store import paths

T = TypeVar("T")
# What `PUT /v1/boxes/<name>` and `update` may change (the key and url: a new `add`).
UPDATABLE = ("pool", "kind", "store", "agent", "max_inflight")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_INFLIGHT_LIMIT = 100_000
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

    def find(self, name: str) -> BoxConfig | None:
        return next((box for box in self.boxes if box.name == name), None)

    def _index(self, name: str) -> int:
        for index, box in enumerate(self.boxes):
            if box.name == name:
                return index
        raise UnknownBox(name)

    def put(self, box: BoxConfig) -> bool:
        """Adds `box`, or replaces the box of that name in place. Returns True when added."""
        box = validate(box)
        try:
            self.boxes[self._index(box.name)] = box
            return False
        except UnknownBox:
            self.boxes.append(box)
            return True

    def remove(self, name: str) -> BoxConfig:
        """Removes and returns the named box. Raises UnknownBox."""
        return self.boxes.pop(self._index(name))

    def update(self, name: str, **fields) -> BoxConfig:
        """Changes the named box's `UPDATABLE` fields (and `blocked`). Raises UnknownBox, or
        ConfigError for a field that may not change or a value that does not validate."""
        index = self._index(name)
        wrong = set(fields) - set(UPDATABLE) - {"blocked"}
        if wrong:
            raise ConfigError(f"box {name}: {', '.join(sorted(wrong))} cannot be changed here "
                              f"(only {', '.join(UPDATABLE)}; add the box again to change url or key)")
        if "kind" in fields:
            try:
                fields["kind"] = BoxKind(fields["kind"])
            except ValueError:
                raise ConfigError(f"box {name}: kind must be one of {', '.join(k.value for k in BoxKind)}") from None
        box = self.boxes[index] = validate(dataclasses.replace(self.boxes[index], **fields))
        return box


class UnknownBox(ConfigError):
    """No box of that name in the file."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no box named {name}")
        self.name = name


def default_path() -> Path:
    """Returns the boxes file's path (rule 1)."""
    return paths.boxes_path()


def validate(box: BoxConfig) -> BoxConfig:
    """Returns `box` when it is well-formed. Raises ConfigError naming the field."""
    if not NAME_RE.fullmatch(box.name):
        raise ConfigError(f"box name {box.name!r} must match {NAME_RE.pattern}")
    parts = urlsplit(box.url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"box {box.name}: url must be http://host:port (got {box.url!r})")
    if parts.path not in ("", "/"):
        raise ConfigError(f"box {box.name}: url must not have a path (got {box.url!r})")
    if box.agent is not None and urlsplit(box.agent).scheme != "http":
        raise ConfigError(f"box {box.name}: agent must be http://host:port (got {box.agent!r})")
    for name in ("key", "store", "pool", "agent"):
        if getattr(box, name) is not None and not isinstance(getattr(box, name), str):
            raise ConfigError(f"box {box.name}: {name} must be a string")
    if not isinstance(box.blocked, bool):
        raise ConfigError(f"box {box.name}: blocked must be true or false")
    limit = box.max_inflight
    if limit is not None and (type(limit) is not int or not 1 <= limit <= MAX_INFLIGHT_LIMIT):
        raise ConfigError(f"box {box.name}: max_inflight must be an integer 1-{MAX_INFLIGHT_LIMIT}")
    return box


def parse(doc: object, path: Path) -> BoxesFile:
    if not isinstance(doc, dict) or not isinstance(doc.get("boxes", []), list):
        raise ConfigError(f"{path}: expected an object with a 'boxes' list")
    boxes: list[BoxConfig] = []
    for entry in doc.get("boxes", []):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{path}: every box needs a 'name'")
        try:
            box = BoxConfig(
                name=entry["name"],
                url=str(entry.get("url", "")).rstrip("/"),
                kind=BoxKind(entry.get("kind", BoxKind.HUGPY.value)),
                key=entry.get("key"),
                store=entry.get("store"),
                pool=entry.get("pool"),
                blocked=bool(entry.get("blocked", False)),
                agent=entry.get("agent"),
                max_inflight=entry.get("max_inflight"),
            )
        except ValueError as exc:
            raise ConfigError(f"{path}: box {entry['name']}: {exc}") from None
        if any(b.name == box.name for b in boxes):
            raise ConfigError(f"{path}: box name {box.name!r} appears twice")
        boxes.append(validate(box))
    return BoxesFile(path, boxes)


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
        raise ConfigError(f"{path} is not valid JSON: {exc.msg}") from None
    return parse(doc, path)


def save(boxes: BoxesFile) -> None:
    """Writes the file atomically with mode 0600."""
    path = boxes.path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = orjson.dumps({"boxes": [b.to_json() for b in boxes.boxes]}, option=orjson.OPT_INDENT_2)
    fd, tmp = tempfile.mkstemp(prefix=".boxes-", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
