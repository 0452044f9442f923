"""Which open client connections to close: the per-client cap and the drain near the listener's
limit. Pure, stdlib only.

A connection is a `Conn`: the TCP peer's packed address (4 or 16 bytes, as the kernel gives it:
no text is made per connection), a number that grows with the connection's age (the socket's
inode: the kernel numbers sockets as it makes them, in per-CPU batches, so the order is close to
creation order, not exact), how long it has been idle, and whether it is working.

Idle and working: a connection is *working* while a request on it is in flight (the app is
handling it) or the kernel holds bytes of it not yet read or not yet sent; otherwise it is
*idle*: a kept-alive connection between requests, or one that never sent a request. Its idle
time is the kernel's time since data last went either way on it (for a never-used connection,
its age). Only an idle connection may be closed, and only once it has been idle FRESH_MS or
seen idle (`unstarted_ms`: since the first look that found it not working) for as long: one that
carried data more recently may hold a request Granian has read and the app has not started yet
(then neither the app nor the kernel counts it working), and closing it would cut that call
before its head; such a request starts within the loop's lag, while a client that trickles a head
a byte at a time stays fresh and never starts, and is closed a FRESH_MS after it was first seen.

Rules:
1. Connections are grouped by peer address; an IPv4-mapped IPv6 peer (`::ffff:a.b.c.d`) counts
   as its IPv4 address, so one client is one group whichever way it reached a dual-stack
   listener. The address is the TCP peer, never a forwarded header: a header costs nothing to
   forge.
2. A peer in one of the trusted-proxy nets is never capped: it carries many clients.
3. A group over `cap` loses idle connections, the longest idle first (then the oldest), until
   it is at the cap or has no idle one left. A working connection is never closed: 520 idle
   sockets from an address cannot cut a stream it opened after them (issue 20 item 7). The cap
   therefore bounds what an address holds idle; what it has working is bounded by the queue and
   the boxes' limits.
4. `cap` 0 is no cap.
5. Near the limit (issue 20 item 8). When a listener's connections, less those rule 3 closes,
   reach NEAR_LIMIT of its `limit` (Granian's accept permits: at the limit it stops accepting,
   and a new client, a health probe included, waits in the kernel's accept queue), its idle
   connections are closed, the longest idle first, until none is idle or what remains leaves
   room for every connection `waiting` in that queue below DRAIN_TO of the limit (but no more
   than down to DRAIN_FLOOR of it): the queue is first in, first out, so a probe behind a burst
   of idle sockets gets a permit at the next look, not after the burst. Every address counts, trusted proxies too: an idle keep-alive connection costs its
   client only a reconnect. So many addresses, each under the cap, cannot hold every permit with
   idle sockets. (nginx does the same when it runs out of connections: it closes idle keep-alive
   connections, oldest first, `ngx_drain_connections`.) `limit` 0 is no limit.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable, NamedTuple

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


# ::ffff:0:0/96, the IPv4-mapped IPv6 addresses (RFC 4291 §2.5.5.2).
V4_MAPPED_PREFIX = bytes(10) + b"\xff\xff"
# Rule 5: the drain starts at 90 % of the permits and leaves 80 %. The gap is what arrives
# between two looks (SWEEP_S apart) without a new client waiting, and one look closes at most a
# tenth of the permits: a burst of idle sockets is drained over a few looks, not all at once.
NEAR_LIMIT = 0.9
DRAIN_TO = 0.8
# However long the accept queue, a look leaves at least half the permits held: a flood that
# refills the queue as fast as it drains is closed a half at a time, not all at once.
DRAIN_FLOOR = 0.5


class Conn(NamedTuple):
    peer: bytes  # packed peer address, 4 or 16 bytes
    conn_id: int  # grows with age (the socket's inode)
    idle_ms: int  # since data last went either way (never used: its age)
    working: bool  # a request in flight, or bytes not yet read or sent
    unstarted_ms: int = 0  # since a look first found it not working (serve/conn_cap.py keeps it)


def peer_key(peer: bytes) -> bytes:
    """The group a packed peer address belongs to (rule 1)."""
    if len(peer) == 16 and peer.startswith(V4_MAPPED_PREFIX):
        return peer[12:]
    return peer


# A burst of new streams keeps a read request waiting for the loop for 100 ms and more
# (bench/run.py open_streams_10k: 9,488 streams opened 1,000 a second, their first frame's p99
# 124 ms; the drain then cut 80 of them before their head). A second is well past that and still
# drains an idle keep-alive, a socket that never sent a request or one that trickles its head, one
# look after its first idle (or first seen) second.
FRESH_MS = 1000


def _closable(conn: Conn) -> bool:
    return not conn.working and (conn.idle_ms >= FRESH_MS or conn.unstarted_ms >= FRESH_MS)


def _longest_idle_first(conn: Conn) -> tuple[int, int]:
    return (-conn.idle_ms, conn.conn_id)


def over_cap(conns: Iterable[Conn], cap: int, trusted_proxies: Iterable[Network]) -> list[int]:
    """The ids of the connections to close under the per-client cap (rules 1-4).

    Raises ValueError when a peer is not 4 or 16 bytes (a bug of the caller); a `cap` of 0 or
    less is no cap.
    """
    if cap <= 0:
        return []
    groups: dict[bytes, list[Conn]] = {}
    for conn in conns:
        groups.setdefault(peer_key(conn.peer), []).append(conn)
    proxies = tuple(trusted_proxies)
    cut: list[int] = []
    for peer, group in groups.items():
        if len(group) <= cap or _trusted(peer, proxies):
            continue
        idle = sorted(filter(_closable, group), key=_longest_idle_first)
        cut.extend(c.conn_id for c in idle[: len(group) - cap])
    return cut


def near_limit(conns: Iterable[Conn], limit: int, closing: Iterable[int] = (), waiting: int = 0) -> list[int]:
    """The ids of one listener's connections to close near its `limit` (rule 5), besides those
    in `closing` (rule 3's, already going); `waiting`: the connections in its accept queue. A
    `limit` of 0 or less is no limit."""
    if limit <= 0:
        return []
    gone = set(closing)
    left = [c for c in conns if c.conn_id not in gone]
    if len(left) < limit * NEAR_LIMIT:
        return []
    idle = sorted(filter(_closable, left), key=_longest_idle_first)
    keep = max(int(limit * DRAIN_TO) - waiting, int(limit * DRAIN_FLOOR))
    return [c.conn_id for c in idle[: max(0, len(left) - keep)]]


def _trusted(peer: bytes, proxies: tuple[Network, ...]) -> bool:
    if not proxies:
        return False
    ip = ipaddress.ip_address(peer)  # packed bytes: 4 is IPv4, 16 IPv6
    return any(ip in net for net in proxies)
