"""The per-client connection cap (`--max-conns-per-client`), enforced from outside Granian.

Why from outside: Granian 2.8 gives the app no per-connection hook. The app first hears of a
connection when a whole request head has arrived and never hears that one closed, so a
connection that stays idle never reaches it. A cap counted per request would miss exactly the
idle connections that take Granian's accept permits. So the cap looks at the sockets:

1. Every SWEEP_S, one sock_diag (netlink) dump per listener port lists the TCP connections on it
   with their peer and inode. The kernel filters by local port; no privilege is needed and no
   system call is made per connection. A connection still in the kernel's accept queue (inode
   0) is not the router's yet and is not counted.
2. router.core.conn_cap picks the connections over the cap (trusted proxies are exempt).
3. Each is closed with shutdown(SHUT_RDWR) on a duplicate of its descriptor, found through
   /proc/self/fd and checked by inode on the duplicate, so a descriptor number reused in the
   meantime is never hit. Granian sees the connection end, drops it and frees its accept permit;
   a call in flight on it ends as a client that left.
4. The sweep runs in a worker thread, never on the event loop: a dump costs about a microsecond
   per connection; the /proc/self/fd walk runs only when something is over the cap.

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
# long. 0.25 s keeps that small while idle sweeps cost ~0.1 ms each.
SWEEP_S = 0.25
# At most one log line this often while the cap is closing connections.
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
# TCP states not dumped: TIME_WAIT (6) and the request socks of SYN_RECV (3) and NEW_SYN_RECV
# (12) hold no descriptor; LISTEN (10) is the listener itself.
DIAG_STATES = 0xFFFFFFFF & ~((1 << 3) | (1 << 6) | (1 << 10) | (1 << 12))
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
        closed_since_log, logged_at = 0, time.monotonic()
        try:
            while True:
                await asyncio.sleep(SWEEP_S)
                try:
                    closed_since_log += await loop.run_in_executor(None, self.sweep)
                except OSError as exc:
                    log.warning("per-client connection cap is off: sock_diag failed: %s", exc)
                    return
                now = time.monotonic()
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
        conns = [conn for port in self.ports for conn in self.connections(port)]
        cut = conn_cap.excess(conns, self.cap, self.proxies)
        if not cut:
            return 0
        fds = _fds_by_inode(set(cut))
        closed = sum(_shut(fds[inode], inode) for inode in cut if inode in fds)
        self.closed_total += closed
        return closed

    def connections(self, port: int) -> list[tuple[str, int]]:
        """(peer address, inode) of each accepted connection on `port`."""
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
        size = 4 if self.family == socket.AF_INET else 16
        out: list[tuple[str, int]] = []
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
                local = data[msg + MSG_LOCAL:msg + MSG_LOCAL + size]
                if inode and (self.local is None or local == self.local):
                    peer = data[msg + MSG_PEER:msg + MSG_PEER + size]
                    out.append((socket.inet_ntop(self.family, peer), inode))
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
