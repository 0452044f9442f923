"""Routing loops (issue 20 item 5, issue 36 item 9): a call that comes back to the router that
sent it ends at once.

Rules:
1. Each router process has its own pseudonym, `hugpy-router-<16 hex>`, random at start: it names
   no host and no version, and two routers never share one.
2. A proxied call's request to a box carries two marks of its path, each the client's own lines
   then this router's:
   a. `Via: ..., 1.1 <pseudonym>` (RFC 9110 §7.6.3: each intermediary appends its hop). A loop
      through another router (which does the same) or through a proxy that passes `Via` on
      (nginx and HAProxy do) comes back carrying it.
   b. `X-Router-Hops: ..., <pseudonym>`, the router's own header: a proxy that drops or replaces
      `Via` (some do, to hide the path) passes an unknown request header on untouched. Through
      such a hop one call became 1,100 rows and 25 MiB of route log before this mark.
3. A call whose `Via` or `X-Router-Hops` already names this router's pseudonym has passed it:
   508 `loop_detected` in the facade's shape, before its body is read; it reaches no box and is
   one route-log row. Without it one call became 848 rows and 256 sockets.
"""

from __future__ import annotations

import os

from router.serve.edge import Edge

PSEUDONYM = "hugpy-router-" + os.urandom(8).hex()
HOP = "1.1 " + PSEUDONYM
HOPS_HEADER = "x-router-hops"
# The request lines of a call that came with neither mark (nearly every call): built once.
HOP_LINES = f"Via: {HOP}\r\nX-Router-Hops: {PSEUDONYM}\r\n".encode()
LOOP_MESSAGE = ("this call has already passed this router (its Via or X-Router-Hops names it): a "
                "box's URL, or a proxy behind one, leads back to the router")


def looped(edge: Edge) -> bool:
    """True when the call already passed this router (rule 3). Two dict lookups per call; the
    lines are joined only when a mark came."""
    if edge.header("via") is not None and PSEUDONYM in (edge.header_lines("via") or ""):
        return True
    return edge.header(HOPS_HEADER) is not None and PSEUDONYM in (edge.header_lines(HOPS_HEADER) or "")


def hop_lines(edge: Edge) -> bytes:
    """The `Via` and `X-Router-Hops` request lines for the box (rule 2)."""
    via, hops = edge.header("via"), edge.header(HOPS_HEADER)
    if via is None and hops is None:
        return HOP_LINES
    via = HOP if via is None else f"{edge.header_lines('via')}, {HOP}"
    hops = PSEUDONYM if hops is None else f"{edge.header_lines(HOPS_HEADER)}, {PSEUDONYM}"
    return f"Via: {via}\r\nX-Router-Hops: {hops}\r\n".encode("latin-1")
