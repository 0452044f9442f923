"""This router's own listeners, which no box URL may name (router.core.box_fields rule 8): a box
that is the router itself turns one call into an endless chain of calls to itself.

Rules:
1. The serving router knows its listeners (`Listening`) and checks every box against them at
   start (the start stops, exit 2), at each reload (the file is not applied) and before an
   admin API edit is written (400).
2. The CLI learns them from the record a running router keeps beside its boxes file,
   `<boxes file>.listeners` (JSON: pid, bind host, ports), written at start and removed at stop.
   A record whose process is gone is ignored. Where the router cannot write beside the file (a
   read-only folder), there is no record and the CLI cannot tell; the running router's reload
   still refuses the entry (rule 1).
3. Host names are not resolved beyond the machine's own name (`own_hosts`): a DNS name that
   points back here is caught by the hop marker on the call path instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import orjson

from router.boxes.config import BoxConfig
from router.core.box_fields import names_listener
from router.core.errors import ConfigError

log = logging.getLogger("router.boxes")


class NamesThisRouter(ConfigError):
    """A box's URL is one of this router's listeners; `number` is its entry, from 1."""

    def __init__(self, number: int, box: BoxConfig) -> None:
        super().__init__(f"box {box.name}: url {box.url} is this router's own listener: a call sent "
                         "there would come back here")
        self.number = number


@dataclass
class Listening:
    host: str  # the bind address
    ports: frozenset[int]
    own_hosts: frozenset[str] | None = None  # this machine's names and addresses, once needed

    def check(self, boxes: Iterable[BoxConfig]) -> None:
        """Raises NamesThisRouter for the first box whose URL is one of these listeners. The
        machine's own names are looked up only for a box on one of the ports (`own_hosts`)."""
        for number, box in enumerate(boxes, 1):
            port = box.port
            if port not in self.ports:
                continue
            if self.own_hosts is None:
                self.own_hosts = own_hosts()
            if names_listener(box.host, port, self.host, self.ports, self.own_hosts):
                raise NamesThisRouter(number, box)


def own_hosts() -> frozenset[str]:
    """This machine's host name and the addresses it resolves to (may wait on the resolver)."""
    name = socket.gethostname().lower()
    found = {name}
    with contextlib.suppress(OSError):
        found.update(info[4][0].lower() for info in socket.getaddrinfo(name, None))
    return frozenset(found)


def record_path(boxes_path: Path) -> Path:
    return boxes_path.with_name(boxes_path.name + ".listeners")


def write_record(boxes_path: Path, host: str, ports: Iterable[int]) -> None:
    """Rule 2: a failure is logged, never fatal."""
    path = record_path(boxes_path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # O_EXCL, never a planted link
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps({"pid": os.getpid(), "host": host, "ports": sorted(ports)}))
        os.replace(tmp, path)
    except FileNotFoundError:  # no folder yet (no boxes file): nothing for the CLI to find
        log.debug("no listeners record: %s does not exist", path.parent)
    except OSError as exc:
        log.info("no listeners record beside %s (%s): `router boxes` cannot check for this router's "
                 "ports, the reload still does", boxes_path, exc.strerror)


def remove_record(boxes_path: Path) -> None:
    with contextlib.suppress(OSError):
        path = record_path(boxes_path)
        if orjson.loads(path.read_bytes()).get("pid") == os.getpid():
            path.unlink()


def read_record(boxes_path: Path) -> Listening | None:
    """The listeners of the router serving `boxes_path`, or None when none is known (rule 2)."""
    try:
        doc = orjson.loads(record_path(boxes_path).read_bytes())
        pid, host, ports = int(doc["pid"]), str(doc["host"]), frozenset(int(p) for p in doc["ports"])
    except (OSError, ValueError, TypeError, KeyError, orjson.JSONDecodeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's (a system unit)
    return Listening(host, ports)
