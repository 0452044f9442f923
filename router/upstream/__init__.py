"""Pooled HTTP/1.1 client to boxes, on the running (uv)loop, parsing with httptools."""

from router.upstream.pool import (
    ExchangeAborted,
    ConnectFailed,
    ConnectionLost,
    Exchange,
    FirstByteTimeout,
    Origin,
    UpstreamError,
)

__all__ = [
    "ExchangeAborted",
    "ConnectFailed",
    "ConnectionLost",
    "Exchange",
    "FirstByteTimeout",
    "Origin",
    "UpstreamError",
]
