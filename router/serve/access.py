"""Who may call: the access rules of router.core.access, applied per call with no I/O.

The settings are read once at start (`HUGPY_ROUTER_KEY`, `HUGPY_ROUTER_REQUIRE_KEY`,
`HUGPY_ROUTER_TRUSTED_NETS`, `HUGPY_ROUTER_TRUSTED_PROXIES`); keys come from the KeyStore's
in-memory map, which a background task refreshes off the event loop.
"""

from __future__ import annotations

import os
import time

from router.core import access
from router.core.access import Verdict
from router.core.admission import Priority, effective_priority
from router.store.keys import KeyStore


# Distinct client addresses whose "inside" verdict is remembered: parsing an address and
# walking the nets costs a few µs per call, a dict lookup well under one.
INSIDE_CACHE_SIZE = 4096


class AccessGate:
    def __init__(self, keys: KeyStore, environ=os.environ) -> None:
        self.keys = keys
        self.admin_key = environ.get("HUGPY_ROUTER_KEY") or None
        self.mode = access.require_key_mode(environ.get("HUGPY_ROUTER_REQUIRE_KEY"))
        self.inside_nets = access.inside_nets(environ.get("HUGPY_ROUTER_TRUSTED_NETS"))
        self.proxies = access.proxy_nets(environ.get("HUGPY_ROUTER_TRUSTED_PROXIES"))
        self._inside: dict[str | None, bool] = {}

    def inside(self, addr: str | None) -> bool:
        verdict = self._inside.get(addr)
        if verdict is None:
            if len(self._inside) >= INSIDE_CACHE_SIZE:
                self._inside.clear()
            verdict = self._inside[addr] = access.is_inside(addr, self.inside_nets)
        return verdict

    def client(self, edge) -> str | None:
        """The address judged for this call (None: unknown, so outside)."""
        if self.proxies or any(edge.header(name) is not None for name in access.FORWARDED_HEADERS):
            return access.client_address(edge.client, edge.header, self.proxies)
        return edge.client or None  # no forwarding: the peer itself

    def caller_of(self, edge, asked: Priority | None) -> tuple[str, Priority]:
        """Who a waiting call waits as (its valid key, else its address) and in which class
        (its key's, lowered by what the call asks). Only on the wait queue's path."""
        token = access.bearer_token(edge.header("authorization"))
        if token and self.keys.scope_of(token, time.time(), self.admin_key) is not None:
            parsed = access.parse_key(token)
            key_id = parsed[0] if parsed is not None else "admin"  # HUGPY_ROUTER_KEY itself
            return f"key:{key_id}", effective_priority(self.keys.priority_of(key_id), asked)
        return f"addr:{self.client(edge)}", effective_priority(Priority.NORMAL, asked)

    def check(self, edge, scope: str) -> Verdict:
        if scope == "use" and self.mode == "never":
            return access.ALLOW
        addr = self.client(edge)
        if scope == "use" and self.mode == "outside" and self.inside(addr):
            return access.ALLOW  # inside callers' keys are not looked at (hugpy's rule)
        token = access.bearer_token(edge.header("authorization"))
        key_scope = self.keys.scope_of(token, time.time(), self.admin_key) if token else None
        return access.decide_access(scope, self.mode, addr, key_scope, token is not None, self.inside_nets)
