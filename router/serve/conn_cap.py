"""The per-client connection cap (`--max-conns-per-client`), enforced from outside Granian.

Why from outside: Granian 2.8 gives the app no per-connection hook. The app first hears of a
connection when a whole request head has arrived and never hears that one closed, so a
connection that stays idle never reaches it. A cap counted per request would miss exactly the
idle connections that take Granian's accept permits. So the cap looks at the sockets:

1. Every SWEEP_S or so, one sock_diag (netlink) dump per listener port lists the TCP connections on it
   with their peer and inode. The kernel filters by local port; no privilege is needed and no
   system call is made per connection. A connection still in the kernel's accept queue (inode
   0) is not the router's yet and is not counted.
2. router.core.conn_cap picks the connections over the cap (trusted proxies are exempt).
3. Each is closed with shutdown(SHUT_RDWR) on a duplicate of its descriptor, found through
   /proc/self/fd and checked by inode on the duplicate, so a descriptor number reused in the
   meantime is never hit. Granian sees the connection end, drops it and frees its accept permit;
   a call in flight on it ends as a client that left.
4. The sweep runs in a worker thread, never on the event loop, and its period stretches with its
   cost (SWEEP_COST_RATIO). It dumps nothing while the process holds fewer descriptors than the
   cap, since then no client can be over it; the /proc/self/fd walk to find a descriptor runs
   only when something is over the cap.

Between sweeps one address can open more than the cap; the listener's permits (server.py rule
1) are sized well above that, and the next sweep closes the excess. Linux only (sock_diag,
/proc): elsewhere the cap is off, with a warning at start.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import struct
import sys
import time

from router.core import conn_cap

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
DIAG_SOCKID_PORTS = struct.Struct("!HH")
DIAG_SOCKID_REST = 44
# The TCP states of a connection that holds a descriptor (include/net/tcp_states.h):
# ESTABLISHED 1, FIN_WAIT1 4, FIN_WAIT2 5, CLOSE_WAIT 8, LAST_ACK 9, CLOSING 11. Not asked for:
# the listener (LISTEN 10), what holds no descriptor (SYN_RECV 3, TIME_WAIT 6, NEW_SYN_RECV 12),
# and bound sockets never connected (CLOSE 7, BOUND_INACTIVE 13: dumped without the port filter).
DIAG_STATES = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11)
# In inet_diag_msg: the peer address at 24 (16 bytes), the local address at 8, the inode at 68.
MSG_LOCAL = 8
MSG_PEER = 24
MSG_INODE = 68
INODE = struct.Struct("=I")


class ConnCap:
    """Closes, every SWEEP_S, each client's connections over `cap` on the given listener ports."""

    def __init__(self, host: str, ports: list[int], cap: int, trusted_proxies) -> None:
        self.cap = cap
        self.ports = ports
        self.proxies = tuple(trusted_proxies)
        address = ipaddress.ip_address(host)
        self.family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        # A listener on one address shares its port number with nothing of ours, but another
        # program may listen on the same port at another address: only ours count.
        self.local = None if address.is_unspecified else address.packed
        self._netlink: socket.socket | None = None
        self.closed_total = 0

    async def run(self) -> None:
        if self.cap <= 0:
            return
        if not sys.platform.startswith("linux"):
            log.warning("--max-conns-per-client needs Linux (sock_diag); no per-client cap")
            return
        loop = asyncio.get_running_loop()
        closed_since_log, logged_at = 0, -LOG_EVERY_S  # the first close is logged at once
        interval = SWEEP_S
        try:
            while True:
                await asyncio.sleep(interval)
                started = time.monotonic()
                try:
                    closed_since_log += await loop.run_in_executor(None, self.sweep)
                except OSError as exc:
                    log.warning("per-client connection cap is off: sock_diag failed: %s", exc)
                    return
                now = time.monotonic()
                interval = min(MAX_SWEEP_S, max(SWEEP_S, (now - started) * SWEEP_COST_RATIO))
                if closed_since_log and now - logged_at >= LOG_EVERY_S:
                    log.warning(
                        "closed %d connections over the per-client cap of %d", closed_since_log, self.cap
                    )
                    closed_since_log, logged_at = 0, now
        finally:
            if self._netlink is not None:
                self._netlink.close()

    def sweep(self) -> int:
        """One look (rules 1-3); returns how many connections it closed. Raises OSError when
        sock_diag is unavailable."""
        if len(os.listdir("/proc/self/fd")) <= self.cap:
            return 0  # no client can be over the cap: skip the dump's walk of the socket table
        conns = [conn for port in self.ports for conn in self.connections(port)]
        cut = conn_cap.excess(conns, self.cap, self.proxies)
        if not cut:
            return 0
        fds = _fds_by_inode(set(cut))
        closed = sum(_shut(fds[inode], inode) for inode in cut if inode in fds)
        self.closed_total += closed
        return closed

    def connections(self, port: int) -> list[tuple[bytes, int]]:
        """(packed peer address, inode) of each accepted connection on `port`."""
        if self._netlink is None:
            self._netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        request = (
            DIAG_REQUEST.pack(self.family, socket.IPPROTO_TCP, 0, 0, DIAG_STATES)
            + DIAG_SOCKID_PORTS.pack(port, 0)
            + bytes(DIAG_SOCKID_REST)
        )
        header = NLMSG_HEADER.pack(NLMSG_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY,
                                   NLM_F_REQUEST_DUMP, 1, 0)
        self._netlink.sendto(header + request, (0, 0))
        size, local = (4 if self.family == socket.AF_INET else 16), self.local
        out: list[tuple[bytes, int]] = []
        while True:
            data = self._netlink.recv(1 << 20)
            offset = 0
            while offset < len(data):
                length, kind = NLMSG_HEADER.unpack_from(data, offset)[:2]
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    errno_ = -struct.unpack_from("=i", data, offset + NLMSG_HEADER.size)[0]
                    raise OSError(errno_, os.strerror(errno_))
                msg = offset + NLMSG_HEADER.size
                inode = INODE.unpack_from(data, msg + MSG_INODE)[0]
                if inode and (local is None or data[msg + MSG_LOCAL:msg + MSG_LOCAL + size] == local):
                    out.append((data[msg + MSG_PEER:msg + MSG_PEER + size], inode))
                offset += (length + 3) & ~3


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
