"""This router's own listeners, which no box URL may name (router.core.box_fields rule 8): a box
that is the router itself turns one call into an endless chain of calls to itself.

Rules:
1. The serving router knows its listeners (`Listening`) and checks every box against them at
   start (the start stops, exit 2), at each reload (the file is not applied) and before an
   admin API edit is written (400).
2. The CLI learns them from the record a running router keeps beside its boxes file,
   `<boxes file>.listeners` (JSON: pid, bind host, ports, the first its main listener: where
   `router aliases set` asks it), written at start and removed at stop.
   A record whose process is gone is ignored. Where the router cannot write beside the file (a
   read-only folder), there is no record and the CLI cannot tell; the running router's reload
   still refuses the entry (rule 1).
3. Host names are not resolved beyond the machine's own name (`own_hosts`): a DNS name that
   points back here is caught by the hop marker on the call path instead.
4. Several routers on one database each announce their listeners in its `routers` table (a
   `Peer`: bind host, ports, machine name, the machine's names and addresses), at start, and
   withdraw them at stop (a router killed keeps its row until it starts again under its
   instance name). Every router's admin API and the CLI refuse a box whose URL is any known
   router's listener (`check_peers`): on the peer's machine by rule 8 of router.core.box_fields,
   from another machine only by one of the peer's own names or addresses (a loopback there is
   this machine, not the peer's).
5. A registry entry that names this router's own listener (made elsewhere: a peer that did not
   know this router yet, a hand edit) is skipped and said, never a reason to leave the rest of
   the registry unapplied (router.boxes.fleet rule 3).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import orjson

from router.boxes.config import BoxConfig
from router.core.box_fields import LOOPBACK_NAMES, WILDCARD_HOSTS, names_listener
from router.core.errors import ConfigError

log = logging.getLogger("router.boxes")


class NamesAPeer(ConfigError):
    """A box's URL is another router's listener (rule 4)."""

    def __init__(self, box: BoxConfig, peer: "Peer") -> None:
        super().__init__(f"box {box.name}: url {box.url} is router {peer.instance}'s listener (a router on "
                         "this database): a call sent there would come back through it")


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
    main: int | None = None  # the main listener's port (its admin API), where a record names it

    def check(self, boxes: Iterable[BoxConfig]) -> None:
        """Raises NamesThisRouter for the first box whose URL is one of these listeners. The
        machine's own names are looked up only for a box on one of the ports (`own_hosts`)."""
        for number, box in enumerate(boxes, 1):
            if self.named_by(box):
                raise NamesThisRouter(number, box)

    def named_by(self, box: BoxConfig) -> bool:
        """Whether `box`'s URL is one of these listeners."""
        port = box.port
        if port not in self.ports:
            return False
        if self.own_hosts is None:
            self.own_hosts = own_hosts()
        return names_listener(box.host, port, self.host, self.ports, self.own_hosts)


@dataclass(frozen=True)
class Peer:
    """A router's listeners as it announced them on the database (rule 4)."""

    instance: str
    host: str  # its bind address
    ports: frozenset[int]
    machine: str  # its machine's host name
    hosts: frozenset[str]  # its machine's names and addresses

    def doc(self) -> dict:
        return {"host": self.host, "ports": sorted(self.ports), "machine": self.machine, "hosts": sorted(self.hosts)}

    @classmethod
    def from_doc(cls, instance: str, doc: dict) -> "Peer":
        return cls(instance, str(doc["host"]), frozenset(int(p) for p in doc["ports"]), str(doc["machine"]),
                   frozenset(str(h) for h in doc["hosts"]))

    def named_by(self, box: BoxConfig, machine: str) -> bool:
        """Whether `box`'s URL, as written on `machine`, reaches one of these listeners."""
        port = box.port
        if port not in self.ports:
            return False
        if machine == self.machine:
            return names_listener(box.host, port, self.host, self.ports, self.hosts)
        host = box.host.lower().removesuffix(".")
        if host in LOOPBACK_NAMES or host in WILDCARD_HOSTS or _loopback(host):
            return False
        return host in self.hosts or host == self.host.lower()


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def this_peer(instance: str, host: str, ports: Iterable[int]) -> Peer:
    """This router as rule 4 announces it."""
    return Peer(instance, host, frozenset(ports), socket.gethostname().lower(), own_hosts())


def check_peers(boxes: Iterable[BoxConfig], peers: Iterable[Peer]) -> None:
    """Raises NamesAPeer for the first box whose URL is a listener of one of `peers`."""
    machine = socket.gethostname().lower()
    peers = list(peers)
    for box in boxes:
        for peer in peers:
            if peer.named_by(box, machine):
                raise NamesAPeer(box, peer)


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
    """Rule 2 (`ports`: the main listener's first): a failure is logged, never fatal."""
    path = record_path(boxes_path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # O_EXCL, never a planted link
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps({"pid": os.getpid(), "host": host, "ports": list(ports)}))
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
        pid, host, ports = int(doc["pid"]), str(doc["host"]), [int(p) for p in doc["ports"]]
    except (OSError, ValueError, TypeError, KeyError, orjson.JSONDecodeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's (a system unit)
    return Listening(host, frozenset(ports), main=ports[0] if ports else None)
