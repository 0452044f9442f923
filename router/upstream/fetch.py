"""Small whole-answer requests for links (health, state, inventories): not the proxy path."""

from __future__ import annotations

from router.upstream.pool import ConnectFailed, Deadline, Exchange, FirstByteTimeout, Origin, request_head

# Inventory answers are tens of KB (a hugpy state snapshot grows with its catalog); 16 MiB
# leaves room for a large fleet box without letting a broken box fill memory.
FETCH_LIMIT_BYTES = 16 << 20


async def fetch(
    origin: Origin,
    method: str,
    target: str,
    *,
    headers: bytes = b"",
    body: bytes = b"",
    timeout_s: float,
) -> tuple[int, Exchange, bytes]:
    """(status, exchange, body) of one request: the answer within `timeout_s` of the send
    (connecting has its own `CONNECT_TIMEOUT_S`). A `HEAD` ends with the head: its answer has
    no body whatever its Content-Length says, so the connection is closed, not reused.

    Raises ConnectFailed, FirstByteTimeout, ConnectionLost or BadResponse.
    """
    head = request_head(method, target, origin, headers, len(body))
    exchange = await origin.send(head, body)
    exchange.keep(Deadline(timeout_s, FirstByteTimeout(f"no answer within {timeout_s} s")), timer=True)
    try:
        await exchange.head
        data = b"" if method == "HEAD" else await exchange.read_all(FETCH_LIMIT_BYTES)
    finally:
        exchange.done()
    return exchange.status, exchange, data


__all__ = ["fetch", "ConnectFailed"]
