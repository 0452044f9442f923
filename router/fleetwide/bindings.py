"""Affinity bindings on the shared server (router.core.affinity rule 9; docs/several-routers.md):
advisory, so a lost one costs a cache miss, never a wrong answer. A bound key this router does
not know is looked up (one round trip, before the decision) and a binding made or moved here is
written (not waited for), under a digest of the key's identity (never the session id or the
caller in the clear), for BINDING_TTL_S after its last move. The server down: each router's own
bindings only."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable

from router.core.affinity import identity_of
from router.fleetwide.wire import PREFIX, SharedDown, SharedServer, read_out

BINDING_TTL_S = 3600.0  # a conversation idle for an hour may start afresh anywhere


class SharedBindings:
    """Affinity bindings on the shared server, under a digest of a key's identity: its scoped
    parts (router.core.affinity's `Key.scoped`) as text."""

    def __init__(self, server: SharedServer) -> None:
        self.server = server

    @staticmethod
    def _key(scoped: tuple) -> str:
        return PREFIX + "bind:" + hashlib.blake2b(identity_of(*scoped).encode(), digest_size=16).hexdigest()

    def find(self, scoped: tuple) -> Awaitable[str | None] | None:
        """The box another router bound the key to, a round trip away; None while the server is
        down (this router's own bindings only)."""
        return self._find(self._key(scoped)) if self.server.up else None

    async def _find(self, key: str) -> str | None:
        try:
            box = await self.server.call(None, "GET", key)
        except SharedDown:
            return None
        return box.decode(errors="replace") if box else None

    def keep(self, scoped: tuple, box: str) -> None:
        if self.server.up:
            self.server.call(None, "SET", self._key(scoped), box, "PX", int(BINDING_TTL_S * 1000)) \
                .add_done_callback(read_out)
