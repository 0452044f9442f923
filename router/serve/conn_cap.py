"""The per-client connection cap (`--max-conns-per-client`) and the drain of idle connections near
a listener's limit, enforced from outside Granian.

Why from outside: Granian 2.8 gives the app no per-connection hook. The app first hears of a
connection when a whole request head has arrived and never hears that one closed, so a
connection that stays idle never reaches it. A cap counted per request would miss exactly the
idle connections that take Granian's accept permits. So the cap looks at the sockets:

1. Every SWEEP_S or so, one sock_diag (netlink) dump per listener port lists the TCP connections on it
   with their peer, inode, the bytes the kernel holds unread and unsent, and its tcp_info (the
   time since data last went either way: how long it has been idle); and the listener itself,
   whose unread count is the length of its accept queue. The kernel filters by
   local port; no privilege is needed and no system call is made per connection. A connection
   still in the kernel's accept queue (inode 0) is not the router's yet and is not counted.
2. A connection is working when a request on it is in flight: the app counts its requests by
   the client's port (`ProcessState.working_ports`, one dict update at a request's start and end,
   keyed by the port as the interface gives it: Granian's ASGI gives text), and the sweep
   takes their numbers (`port_numbers`) on the loop. Matching by port alone can only take an
   idle connection for a working one (another address's connection on the same port number),
   never the reverse, so an error spares a socket and never cuts a call.
3. router.core.conn_cap picks the idle connections to close: over the per-client cap (trusted
   proxies are exempt), then near a listener's limit (its accept permits). The sweep tells it,
   for each connection not working, how long the looks have found it so (`with_unstarted`: its
   clock starts at the first such look and stops when one finds it working, or gone; a look that
   dumps nothing clears every clock), so that a head trickled a byte at a time, never idle a
   second, is still closed.
4. Each is closed with shutdown(SHUT_RDWR) on a duplicate of its descriptor, found through
   /proc/self/fd and checked by inode on the duplicate, so a descriptor number reused in the
   meantime is never hit. Granian sees the connection end, drops it and frees its accept permit;
   a call in flight on it ends as a client that left.
5. The sweep runs in a worker thread, never on the event loop, and its period stretches with its
   cost (SWEEP_COST_RATIO). It dumps nothing while the process holds fewer descriptors than the
   cap and than the drain's threshold, since then no client can be over the cap and no listener
   near its limit; the /proc/self/fd walk to find a descriptor runs only when something is to
   be closed.

Between sweeps one address can open more than the cap; the listener's permits (server.py rule
1) are sized well above that, and the next sweep closes the excess. Linux only (sock_diag,
/proc): elsewhere the cap and the drain are off, with a warning at start.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import socket
import struct
import sys
import time

from typing import Callable

from router.core import conn_cap
from router.core.conn_cap import Conn

log = logging.getLogger("router.serve")

# How often the cap looks: the most one address can hold over the cap is what it opens in this
# long (and never more than the listener's accept permits). Every SWEEP_S, unless a sweep took
# more than 1/SWEEP_COST_RATIO of that, so that the cap never takes more than 5 % of a core; and
# at least every MAX_SWEEP_S. Measured on the shared 2-core test machine: with fewer descriptors
# than the cap a sweep only counts them (~0.1 ms); otherwise the dump costs 4-10 ms with few
# connections (the kernel walks the whole socket table, every program's) and 25-45 ms with 8,000.
SWEEP_S = 0.25
SWEEP_COST_RATIO = 20
MAX_SWEEP_S = 2.0
# At most one log line this often while the cap is closing connections (the first at once).
LOG_EVERY_S = 10.0

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST_DUMP = 0x1 | 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_HEADER = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid (sport, dport in
# network order, 16-byte src and dst, interface, 8-byte cookie).
DIAG_REQUEST = struct.Struct("=BBBBI")
# idiag_ext: ask for INET_DIAG_INFO (2), the tcp_info, as an attribute after each message.
INET_DIAG_INFO = 2
DIAG_EXT_INFO = 1 << (INET_DIAG_INFO - 1)
DIAG_SOCKID_PORTS = struct.Struct("!HH")
DIAG_SOCKID_REST = 44
# The TCP states of a connection that holds a descriptor (include/net/tcp_states.h):
# ESTABLISHED 1, FIN_WAIT1 4, FIN_WAIT2 5, CLOSE_WAIT 8, LAST_ACK 9, CLOSING 11. Not asked for:
# the listener (LISTEN 10), what holds no descriptor (SYN_RECV 3, TIME_WAIT 6, NEW_SYN_RECV 12),
# and bound sockets never connected (CLOSE 7, BOUND_INACTIVE 13: dumped without the port filter).
# LISTEN 10 is asked for too: the listener's message gives its accept queue's length.
TCP_LISTEN = 10
DIAG_STATES = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11) | (1 << TCP_LISTEN)
# In inet_diag_msg (72 bytes): the state at 1, the peer's port at 6 (network order), the local address at 8,
# the peer address at 24 (16 bytes), the bytes unread and unsent at 56 and 60, the inode at 68.
MSG_PEER_PORT = 6
MSG_LOCAL = 8
MSG_PEER = 24
MSG_QUEUES = 56
MSG_INODE = 68
MSG_SIZE = 72
U32 = struct.Struct("=I")
QUEUES = struct.Struct("=II")
PORT = struct.Struct("!H")
RTATTR = struct.Struct("=HH")
# In tcp_info (linux/tcp.h): tcpi_last_data_sent at 44 and tcpi_last_data_recv at 52, in ms.
TCPI_LAST_DATA_SENT = 44
TCPI_LAST_DATA_RECV = 52
TCPI_MIN_SIZE = 56


class ConnCap:
    """Closes, every SWEEP_S, each client's idle connections over `cap` on the given listener
    ports, and idle connections of a listener near its `limit` (its accept permits).
    `working_ports()`, called on the loop, gives the client ports with a request in flight."""

    def __init__(self, host: str, ports: list[int], cap: int, trusted_proxies, *, limit: int = 0,
                 working_ports: Callable[[], frozenset[int]] = frozenset) -> None:
        self.cap = cap
        self.limit = limit
        self.ports = ports
        self.proxies = tuple(trusted_proxies)
        self.working_ports = working_ports
        address = ipaddress.ip_address(host)
        self.family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        # A listener on one address shares its port number with nothing of ours, but another
        # program may listen on the same port at another address: only ours count.
        self.local = None if address.is_unspecified else address.packed
        self._netlink: socket.socket | None = None
        self.closed_total = 0
        # inode -> when a look first found it not working (router.core.conn_cap `unstarted_ms`);
        # only `sweep` reads and writes it, one look at a time (`run` awaits each)
        self.unstarted_since: dict[int, float] = {}
        # Below this many descriptors no listener is near its limit (rule 5's threshold).
        self.drain_from = math.ceil(limit * conn_cap.NEAR_LIMIT) if limit > 0 else 0

    async def run(self) -> None:
        if self.cap <= 0 and self.limit <= 0:
            return
        if not sys.platform.startswith("linux"):
            log.warning("--max-conns-per-client and the drain of idle connections need Linux "
                        "(sock_diag); neither is on")
            return
        loop = asyncio.get_running_loop()
        closed_since_log = [0, 0]  # over the cap, near the limit
        logged_at = -LOG_EVERY_S  # the first close is logged at once
        interval = SWEEP_S
        try:
            while True:
                await asyncio.sleep(interval)
                started = time.monotonic()
                working = self.working_ports()  # on the loop: the app changes it there
                try:
                    over, near = await loop.run_in_executor(None, self.sweep, working)
                except OSError as exc:
                    log.warning("the per-client connection cap and the drain are off: sock_diag failed: %s", exc)
                    return
                closed_since_log[0] += over
                closed_since_log[1] += near
                now = time.monotonic()
                interval = min(MAX_SWEEP_S, max(SWEEP_S, (now - started) * SWEEP_COST_RATIO))
                if any(closed_since_log) and now - logged_at >= LOG_EVERY_S:
                    if closed_since_log[0]:
                        log.warning("closed %d idle connections over the per-client cap of %d",
                                    closed_since_log[0], self.cap)
                    if closed_since_log[1]:
                        log.warning("closed %d idle connections near a listener's limit of %d",
                                    closed_since_log[1], self.limit)
                    closed_since_log, logged_at = [0, 0], now
        finally:
            if self._netlink is not None:
                self._netlink.close()

    def sweep(self, working: frozenset[int] = frozenset()) -> tuple[int, int]:
        """One look (rules 1-4): how many connections it closed over the cap and near the limit.
        `working`: the client ports with a request in flight. Raises OSError when sock_diag is
        unavailable."""
        fds = len(os.listdir("/proc/self/fd"))
        if (self.cap <= 0 or fds <= self.cap) and (self.limit <= 0 or fds < self.drain_from):
            self.unstarted_since.clear()  # unwatched meanwhile: a clock starts again at the next look
            return 0, 0  # nothing can be over: skip the dump's walk of the socket table
        by_port = {port: self.connections(port, working) for port in self.ports}
        by_port = self.with_unstarted(by_port, time.monotonic())
        over = conn_cap.over_cap((c for conns, _ in by_port.values() for c in conns), self.cap, self.proxies)
        near: list[int] = []
        for conns, waiting in by_port.values():
            near += conn_cap.near_limit(conns, self.limit, over, waiting)
        if not over and not near:
            return 0, 0
        fds_of = _fds_by_inode({*over, *near})
        closed = [sum(_shut(fds_of[i], i) for i in cut if i in fds_of) for cut in (over, near)]
        self.closed_total += closed[0] + closed[1]
        return closed[0], closed[1]

    def with_unstarted(self, by_port: dict[int, tuple[list[Conn], int]], now: float) -> dict[int, tuple[list[Conn], int]]:
        """Each connection not working, with how long the looks have found it so: its clock starts
        at the first such look and ends at the first that finds it working, or gone."""
        since, seen = self.unstarted_since, {}
        out = {}
        for port, (conns, waiting) in by_port.items():
            timed = []
            for conn in conns:
                if not conn.working:
                    first = seen[conn.conn_id] = since.get(conn.conn_id, now)
                    conn = conn._replace(unstarted_ms=int((now - first) * 1000))
                timed.append(conn)
            out[port] = (timed, waiting)
        self.unstarted_since = seen
        return out

    def connections(self, port: int, working: frozenset[int] = frozenset()) -> tuple[list[Conn], int]:
        """Each accepted connection on `port` (rule 1), and how many wait in its listener's
        accept queue; `working`: the client ports with a request in flight (rule 2)."""
        if self._netlink is None:
            self._netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        request = (
            DIAG_REQUEST.pack(self.family, socket.IPPROTO_TCP, DIAG_EXT_INFO, 0, DIAG_STATES)
            + DIAG_SOCKID_PORTS.pack(port, 0)
            + bytes(DIAG_SOCKID_REST)
        )
        header = NLMSG_HEADER.pack(NLMSG_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY,
                                   NLM_F_REQUEST_DUMP, 1, 0)
        self._netlink.sendto(header + request, (0, 0))
        size, local = (4 if self.family == socket.AF_INET else 16), self.local
        out: list[Conn] = []
        waiting = 0
        while True:
            data = self._netlink.recv(1 << 20)
            offset = 0
            while offset < len(data):
                length, kind = NLMSG_HEADER.unpack_from(data, offset)[:2]
                if kind == NLMSG_DONE:
                    return out, waiting
                if kind == NLMSG_ERROR:
                    errno_ = -struct.unpack_from("=i", data, offset + NLMSG_HEADER.size)[0]
                    raise OSError(errno_, os.strerror(errno_))
                msg = offset + NLMSG_HEADER.size
                inode = U32.unpack_from(data, msg + MSG_INODE)[0]
                if inode and (local is None or data[msg + MSG_LOCAL:msg + MSG_LOCAL + size] == local):
                    unread, unsent = QUEUES.unpack_from(data, msg + MSG_QUEUES)
                    if data[msg + 1] == TCP_LISTEN:  # the listener: `unread` is its accept queue
                        waiting += unread
                    else:
                        busy = bool(unread or unsent) or PORT.unpack_from(data, msg + MSG_PEER_PORT)[0] in working
                        out.append(Conn(data[msg + MSG_PEER:msg + MSG_PEER + size], inode,
                                        _idle_ms(data, msg + MSG_SIZE, offset + length), busy))
                offset += (length + 3) & ~3


def port_numbers(ports) -> frozenset[int]:
    """The client ports of `ProcessState.working_ports` as numbers (rule 2); an unknown one is left out."""
    return frozenset(int(port) for port in ports if isinstance(port, int) or port.isdigit())


def _idle_ms(data: bytes, start: int, end: int) -> int:
    """The ms since data last went either way, from the message's tcp_info attribute; 0 (just
    active: closed last) when the kernel sent none."""
    while start + RTATTR.size <= end:
        length, kind = RTATTR.unpack_from(data, start)
        if length < RTATTR.size:
            break
        if kind == INET_DIAG_INFO and length - RTATTR.size >= TCPI_MIN_SIZE:
            info = start + RTATTR.size
            return min(U32.unpack_from(data, info + TCPI_LAST_DATA_SENT)[0],
                       U32.unpack_from(data, info + TCPI_LAST_DATA_RECV)[0])
        start += (length + 3) & ~3
    return 0


def _fds_by_inode(wanted: set[int]) -> dict[int, int]:
    """Our descriptors of the sockets whose inode is in `wanted`."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inode = int(link[8:-1])
            if inode in wanted:
                found[inode] = int(name)
    return found


def _shut(fd: int, inode: int) -> bool:
    """shutdown(SHUT_RDWR) of the socket behind `fd`, if it is still the one with `inode`."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        sock = socket.socket(fileno=dup)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()  # the duplicate is closed below, Granian's descriptor stays
        return True
    except OSError:  # gone meanwhile
        return False
    finally:
        os.close(dup)
