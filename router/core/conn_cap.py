"""The per-client connection cap: which open client connections to close. Pure, stdlib only.

A connection is `(peer, id)`: the TCP peer's packed address (4 or 16 bytes, as the kernel gives
it: no text is made per connection) and a number that grows with the connection's age (the socket's inode: the kernel numbers sockets as it makes them, in per-CPU
batches, so the order is close to creation order, not exact).

Rules:
1. Connections are grouped by peer address; an IPv4-mapped IPv6 peer (`::ffff:a.b.c.d`) counts
   as its IPv4 address, so one client is one group whichever way it reached a dual-stack
   listener. The address is the TCP peer, never a forwarded header: a header costs nothing to
   forge.
2. A peer in one of the trusted-proxy nets is never capped: it carries many clients.
3. A group over `cap` keeps its `cap` oldest connections (lowest ids) and loses the rest, so a
   client's long-running calls outlive the connections it opened last.
4. `cap` 0 is no cap.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


# ::ffff:0:0/96, the IPv4-mapped IPv6 addresses (RFC 4291 §2.5.5.2).
V4_MAPPED_PREFIX = bytes(10) + b"\xff\xff"


def peer_key(peer: bytes) -> bytes:
    """The group a packed peer address belongs to (rule 1)."""
    if len(peer) == 16 and peer.startswith(V4_MAPPED_PREFIX):
        return peer[12:]
    return peer


def excess(conns: Iterable[tuple[bytes, int]], cap: int, trusted_proxies: Iterable[Network]) -> list[int]:
    """Returns the ids of the connections to close (rules 1-4).

    Raises ValueError when a peer is not 4 or 16 bytes (a bug of the caller); a `cap` of 0 or
    less is no cap.
    """
    if cap <= 0:
        return []
    groups: dict[bytes, list[int]] = {}
    for peer, conn_id in conns:
        groups.setdefault(peer_key(peer), []).append(conn_id)
    proxies = tuple(trusted_proxies)
    cut: list[int] = []
    for peer, ids in groups.items():
        if len(ids) <= cap or _trusted(peer, proxies):
            continue
        ids.sort()
        cut.extend(ids[cap:])
    return cut


def _trusted(peer: bytes, proxies: tuple[Network, ...]) -> bool:
    if not proxies:
        return False
    ip = ipaddress.ip_address(peer)  # packed bytes: 4 is IPv4, 16 IPv6
    return any(ip in net for net in proxies)
