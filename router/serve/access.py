"""Who may call: the access rules of router.core.access, applied per call with no I/O.

The settings are read once at start (`HUGPY_ROUTER_KEY`, `HUGPY_ROUTER_REQUIRE_KEY`,
`HUGPY_ROUTER_TRUSTED_NETS`, `HUGPY_ROUTER_TRUSTED_PROXIES`, `HUGPY_ROUTER_ALLOWED_HOSTS`,
`HUGPY_ROUTER_ALLOWED_ORIGINS`); keys come from the KeyStore's in-memory map, which a background
task refreshes off the event loop.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from router.core import access
from router.core.access import Caller, Verdict
from router.core.admission import Priority, effective_priority
from router.core.memo import Memo
from router.core.types import new_tuple
from router.serve.edge import Edge
from router.store.keys import KeyStore


log = logging.getLogger("router.serve")

# Distinct client addresses (and Host values) whose verdict is remembered: parsing an address
# and walking the nets costs a few µs per call, a dict lookup well under one.
INSIDE_CACHE_SIZE = 4096
# The forwarding headers' values on a call that has none of them.
_UNFORWARDED = (None,) * len(access.FORWARDED_HEADERS)


class AccessGate:
    def __init__(self, keys: KeyStore, environ=os.environ) -> None:
        self.keys = keys
        self.admin_key = environ.get("HUGPY_ROUTER_KEY") or None
        self.mode = access.require_key_mode(environ.get("HUGPY_ROUTER_REQUIRE_KEY"))
        self.inside_nets = access.inside_nets(environ.get("HUGPY_ROUTER_TRUSTED_NETS"))
        self.proxies = access.proxy_nets(environ.get("HUGPY_ROUTER_TRUSTED_PROXIES"))
        self.hosts = access.allowed_hosts(environ.get("HUGPY_ROUTER_ALLOWED_HOSTS"))
        self.origins = access.allowed_origins(environ.get("HUGPY_ROUTER_ALLOWED_ORIGINS"))
        # The names a keyless use call may come under (router.core.access rule 8c): the allowed
        # hosts and this machine's own name, whole and as its first label.
        hostname = socket.gethostname().lower().rstrip(".")
        self.use_hosts = self.hosts | {hostname, hostname.partition(".")[0]} - {""}
        # inside[addr]: the address is in the trusted nets; host_served[host]: a keyless use call
        # may be served under that Host (rule 8c)
        self.inside = Memo(lambda addr, nets=self.inside_nets: access.is_inside(addr, nets), INSIDE_CACHE_SIZE)
        self.host_served = Memo(lambda host, names=self.use_hosts: access.serves_host(host, names), INSIDE_CACHE_SIZE)
        # A balancer in front that is not a trusted proxy (rule 14): watched until it is ruled out.
        self.sole_caller = None if self.proxies else access.SoleCaller()

    def describe(self) -> str:
        """The start-up line: the key mode in force, the trusted nets and proxies."""
        nets = ", ".join(str(net) for net in self.inside_nets)
        proxies = ", ".join(str(net) for net in self.proxies) or "none"
        return (f"access: require-key {self.mode}; trusted nets {nets}; trusted proxies {proxies}; "
                "loopback manages without a key in every mode")

    def caller(self, edge: Edge) -> Caller:
        """Who is calling (router.core.access rules 3-6)."""
        # (A map, not a generator: that would make `edge` a cell, allocated on every call.)
        if self.proxies or tuple(map(edge.header, access.FORWARDED_HEADERS)) != _UNFORWARDED:
            return access.client_address(edge.client, edge.header_lines, self.proxies)
        return new_tuple(Caller, (edge.client or None, False))  # no forwarding: the peer itself

    def caller_of(self, edge: Edge, asked: Priority | None) -> tuple[str, Priority]:
        """Who a waiting call waits as (its valid key, else its resolved address) and in which
        class (its key's, lowered by what the call asks). Only on the wait queue's path."""
        token = access.bearer_token(edge.header("authorization"))
        if token and self.keys.scope_of(token, time.time(), self.admin_key) is not None:
            parsed = access.parse_key(token)
            key_id = parsed[0] if parsed is not None else "admin"  # HUGPY_ROUTER_KEY itself
            return f"key:{key_id}", effective_priority(self.keys.priority_of(key_id), asked)
        return f"addr:{edge.caller}", effective_priority(Priority.NORMAL, asked)

    def check(self, edge: Edge, scope: str, *, json_body: bool = False) -> Verdict:
        """The verdict for a route of `scope`; records the caller's address as `edge.caller`
        (for the route log). `json_body`: the route takes a JSON body (rule 11, admin only)."""
        if scope == "public":
            return access.ALLOW
        addr, via_proxy = self.caller(edge)
        edge.caller = addr
        if self.sole_caller is not None:
            self._watch_sole_caller(addr)
        token = access.bearer_token(edge.header("authorization"))
        held = self.keys.holder(token, time.time(), self.admin_key) if token else None
        key_scope = None
        if held is not None:  # whose limits the call counts against (serve/limits.py)
            edge.key_id, key_scope = held
        presented = access.presents_key(token)  # not a placeholder (`x`, `ollama`): rule 1a
        host = edge.header("host")
        origin = edge.header("origin")  # None from SDKs and curl, and a browser's same-origin GET
        origin_ok = origin is None or access.origin_allowed(origin, host, self.origins)
        admin = scope == "admin"
        if not admin:
            host_served = self.host_served[host]
            keyless = self.mode == "never" or (self.mode == "outside" and self.inside[addr])
            if keyless and origin_ok and host_served and (held is not None or not presented):
                return access.ALLOW  # (a presented bad key is refused even here: rule 8b)
        verdict = access.decide_access(
            scope, self.mode, addr, key_scope, token is not None, self.inside_nets,
            via_proxy=via_proxy,
            router_host=admin and access.names_router(host, self.hosts),
            origin_ok=origin_ok,
            host_served=admin or host_served,
            placeholder=not presented,
        )
        if verdict.ok and admin and json_body and not access.is_json(edge.header("content-type")):
            return access.NOT_JSON
        return verdict

    def _watch_sole_caller(self, addr: str | None) -> None:
        """Says once that every call so far came from one private address (rule 14)."""
        watch = self.sole_caller
        if watch.see(addr, self.inside[addr]):
            log.warning(
                "every call so far (%d) came from %s, a private address, and HUGPY_ROUTER_TRUSTED_PROXIES "
                "is empty: if a balancer or proxy stands in front of this router, each caller behind it "
                "counts as that one address (inside, so keyless under HUGPY_ROUTER_REQUIRE_KEY=outside; "
                "one caller for the queue share, --default-rpm and affinity). Run it in HTTP mode with "
                "X-Forwarded-For, list it in HUGPY_ROUTER_TRUSTED_PROXIES and set "
                "HUGPY_ROUTER_REQUIRE_KEY=always (docs/several-routers.md)", watch.calls, addr)
        if watch.over:
            self.sole_caller = None
