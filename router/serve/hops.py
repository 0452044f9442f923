"""Routing loops (issue 20 item 5): a call that comes back to the router that sent it ends at once.

Rules:
1. Each router process has its own pseudonym, `hugpy-router-<16 hex>`, random at start: it names
   no host and no version, and two routers never share one.
2. A proxied call's request to a box carries `Via`: the client's own `Via` lines, then
   `1.1 <pseudonym>` (RFC 9110 §7.6.3: each intermediary appends its hop). A loop through
   another router (which does the same) or through a proxy that passes `Via` on (nginx and
   HAProxy do) comes back carrying it.
3. A call whose `Via` already names this router's pseudonym has passed it: 508 `loop_detected`
   in the facade's shape, before its body is read; it reaches no box and is one route-log row.
   Without it one call became 848 rows and 256 sockets.
"""

from __future__ import annotations

import os

from router.serve.edge import Edge

PSEUDONYM = "hugpy-router-" + os.urandom(8).hex()
HOP = "1.1 " + PSEUDONYM
# The request line of a call that came with no `Via` (nearly every call): built once.
VIA_LINE = f"Via: {HOP}\r\n".encode()
LOOP_MESSAGE = ("this call has already passed this router (its Via names it): a box's URL, or a "
                "proxy behind one, leads back to the router")


def looped(edge: Edge) -> bool:
    """True when the call already passed this router (rule 3). A dict lookup per call; the lines
    are joined only when a `Via` came."""
    return edge.header("via") is not None and PSEUDONYM in (edge.header_lines("via") or "")


def via_line(edge: Edge) -> bytes:
    """The `Via` request line for the box (rule 2)."""
    if edge.header("via") is None:
        return VIA_LINE
    return f"Via: {edge.header_lines('via')}, {HOP}\r\n".encode("latin-1")
