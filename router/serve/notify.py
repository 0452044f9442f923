"""systemd's readiness protocol (sd_notify), for `Type=notify` units (`hugpy-router install`).

Rules:
1. `notify(message)` sends one datagram to `$NOTIFY_SOCKET` (a path, or `@name` for the
   abstract namespace). Without the variable (not under systemd) it does nothing. A send that
   fails is logged and forgotten: readiness is advice, never a reason to stop serving.
2. The server sends `READY=1` once every listener accepts connections and each box has had its
   first inventory read (Fleet.start waits for that, bounded by FIRST_READ_TIMEOUT_S), and
   `STOPPING=1` when it starts to stop. A reload (SIGHUP, the unit's ExecReload) re-reads the
   boxes file and the keys between `RELOADING=1` and `READY=1`.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("router.serve")


def notify(message: str) -> bool:
    """Sends `message` to systemd (rule 1). Returns whether it was sent."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:
        log.warning("systemd notify (%s) not sent: %s", message.split("=")[0], exc)
        return False
    return True
