"""Typed errors. Each carries `status_hint`, the HTTP status the edge should use.

Inside `core` a refusal is a value (`Decision(path=REFUSED)`), never an exception; these are
for misuse, broken peers and bad configuration.
"""


class RouterError(Exception):
    status_hint = 500

    def __init__(self, message: str, *, status_hint: int | None = None):
        super().__init__(message)
        if status_hint is not None:
            self.status_hint = status_hint


class UsageError(RouterError):
    """Our own caller misused an API: a bug in the router."""


class UpstreamProtocolError(RouterError):
    """A box broke HTTP or its stream format."""

    status_hint = 502


class ConfigError(RouterError):
    """Bad configuration, found at load time."""


class BadRequest(RouterError):
    """The client's call is malformed; `code` is the stable error code the facade renders."""

    status_hint = 400

    def __init__(self, message: str, *, code: str = "invalid_request", status_hint: int = 400):
        super().__init__(message, status_hint=status_hint)
        self.code = code
