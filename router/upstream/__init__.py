"""Pooled HTTP/1.1 client to boxes, on the running (uv)loop, parsing with httptools."""

from router.upstream.pool import (
    ClientGone,
    ConnectFailed,
    ConnectionLost,
    Exchange,
    FirstByteTimeout,
    Origin,
    UpstreamError,
)

__all__ = [
    "ClientGone",
    "ConnectFailed",
    "ConnectionLost",
    "Exchange",
    "FirstByteTimeout",
    "Origin",
    "UpstreamError",
]
