"""What a box's fields may hold: the one set of rules for the CLI, the boxes file and the admin
API (router.boxes.config.validate applies them, plus the store file check, which reads a file).

Rules (each check raises ConfigError with one line naming the field and why; a value that may
hold a secret, a key or a URL with a password, is never echoed):
1. name: the hugpy request-id alphabet, `NAME_RE` (it travels in headers and URLs as it is).
2. url: `http` or `https`, a valid host (a DNS name of letters, digits, `-` and `_` labels whose last is
   not a number, an IPv4 dotted quad or a bracketed IPv6 address), a port 1-65535 when one is given, and nothing else:
   no user or password, no path, no query, no fragment, no whitespace or control character
   (Python's urlsplit drops a tab or newline silently, so the raw text is checked first).
3. agent: the same, `http` only (a `router agent` serves plain HTTP).
4. key: visible ASCII only (0x21-0x7E), at most MAX_KEY_CHARS: it goes into a header line of
   every request to the box, where a CR or LF would start a header or a request of its own.
5. pool: printable (no control, bidi or other format character), at most
   MAX_IDENTIFIER_BYTES of UTF-8, like any identifier a call routes by (bounds rule 1).
6. max_inflight: an integer (not a boolean) from 1 to MAX_INFLIGHT_LIMIT; blocked: a boolean.
7. store: an absolute path of printable characters, at most MAX_PATH_CHARS; whether the file
   is a hugpy-wrapper store is the I/O room's check.
8. A URL names one of this router's own listeners (`names_listener`) when its port is one the
   router listens on and its host is the bind address, or, for a loopback or wildcard bind, a
   loopback address (IPv4-mapped too), `localhost`, a wildcard address or one of the
   machine's own names and addresses. Names are
   not resolved: a DNS name that points back here is caught by the hop marker instead.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from router.core.bounds import MAX_IDENTIFIER_BYTES, clip
from router.core.errors import ConfigError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A box takes at most this many calls at once from the router: far above any one server's
# batch (vLLM's default max_num_seqs is 256), low enough to catch a typo of a few digits.
MAX_INFLIGHT_LIMIT = 100_000
# Bearer keys are tens of characters (hugpy's hpk_box_ keys are ~50); nginx's default header
# buffer is 8 KiB, so a key of 4 KiB still fits in a request head.
MAX_KEY_CHARS = 4096
# Linux's PATH_MAX.
MAX_PATH_CHARS = 4096
# How much of a refused URL an error shows.
ECHO_CHARS = 80
_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_VISIBLE_RE = re.compile(r"[\x21-\x7e]+")
# A last label of digits (or 0x and hex digits) makes a name an IPv4 address in the resolver's
# and browsers' eyes (inet_aton's shorthand: `127.1` is 127.0.0.1), never a DNS name: only the
# dotted quad is taken, so no shorthand hides a loopback address from rule 8.
_NUMERIC_LABEL_RE = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
BOX_SCHEMES = ("http", "https")
AGENT_SCHEMES = ("http",)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def check_name(name: object) -> str:
    """Rule 1. Returns the name."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        shown = clip(name, 64) if isinstance(name, str) else type(name).__name__
        raise ConfigError(f"name {shown!r} must be 1-64 of letters, digits, '_', '.', '-' "
                          "(starting with a letter or digit)")
    return name


def valid_host(host: str) -> bool:
    """A DNS name, an IPv4 address or an IPv6 address (urlsplit has taken the brackets off)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if ":" in host or len(host) > 253:
        return False
    if _NUMERIC_LABEL_RE.fullmatch(host.removesuffix(".").rpartition(".")[2]):
        return False  # `127.1`, `2130706433`, `0x7f.0.0.1`: an address in a form ipaddress refused
    return all(_LABEL_RE.fullmatch(label) for label in host.removesuffix(".").split("."))


def check_url(field: str, url: object, schemes: tuple[str, ...] = BOX_SCHEMES) -> tuple[str, str, int]:
    """Rules 2 and 3. Returns (scheme, host, port), the port filled in from the scheme."""
    if not isinstance(url, str):
        raise ConfigError(f"{field} must be a string")
    want = f"{' or '.join(s + '://' for s in schemes)}host:port"
    if not _VISIBLE_RE.fullmatch(url):
        raise ConfigError(f"{field} must be {want}, without spaces or control characters")
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced IPv6 bracket
        raise ConfigError(f"{field} has no valid host") from None
    if "@" in parts.netloc:  # before anything echoes the URL: it may hold a password
        raise ConfigError(f"{field} must not carry a user or password (a box key goes in `key`)")
    # Only the scheme and the host part are echoed: a path or query may carry a token.
    shown = clip(f"{parts.scheme}://{parts.netloc}" if parts.scheme else parts.netloc or url.split("?")[0], ECHO_CHARS)
    if parts.scheme not in schemes:
        raise ConfigError(f"{field} must be {want} (got {shown!r})")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "#" in url or "?" in url:
        raise ConfigError(f"{field} must not have a path, query or fragment (got {shown!r})")
    host = parts.hostname or ""
    if not host or not valid_host(host):
        raise ConfigError(f"{field} has no valid host (got {shown!r}): a DNS name, an IPv4 "
                          "address or a bracketed IPv6 address")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    if not 1 <= port <= 65535:
        raise ConfigError(f"{field} port must be 1-65535 (got {shown!r})")
    return parts.scheme, host, port


def check_key(key: object) -> str | None:
    """Rule 4. Never echoes the key."""
    if key is None:
        return None
    if not isinstance(key, str) or not _VISIBLE_RE.fullmatch(key) or len(key) > MAX_KEY_CHARS:
        raise ConfigError(f"key must be 1-{MAX_KEY_CHARS} visible ASCII characters "
                          "(no space, control character or line break)")
    return key


def check_pool(pool: object) -> str | None:
    """Rule 5; an empty pool is no pool."""
    if pool is None or pool == "":
        return None
    if not isinstance(pool, str) or not pool.isprintable():
        raise ConfigError("pool must be a string of printable characters")
    if len(pool.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES:
        raise ConfigError(f"pool is over {MAX_IDENTIFIER_BYTES} bytes")
    return pool


def check_max_inflight(limit: object) -> int | None:
    """Rule 6."""
    if limit is not None and (type(limit) is not int or not 1 <= limit <= MAX_INFLIGHT_LIMIT):
        raise ConfigError(f"max_inflight must be an integer 1-{MAX_INFLIGHT_LIMIT} (got {clip(repr(limit), 32)})")
    return limit


def check_blocked(blocked: object) -> bool:
    """Rule 6."""
    if not isinstance(blocked, bool):
        raise ConfigError("blocked must be true or false")
    return blocked


def check_store_path(store: object) -> str | None:
    """Rule 7: the path's shape only."""
    if store is None:
        return None
    if not isinstance(store, str) or not store.isprintable() or not store.startswith("/") \
            or len(store) > MAX_PATH_CHARS:
        raise ConfigError("store must be the absolute path of the box's fitevict.sqlite3")
    return store


def names_listener(
    host: str, port: int, bind_host: str, ports: frozenset[int], own_hosts: frozenset[str]
) -> bool:
    """Rule 8: whether http(s)://`host`:`port` reaches this router, which listens on `ports` of
    `bind_host`; `own_hosts` are the machine's own names and addresses, lower case."""
    if port not in ports:
        return False
    host = host.lower().removesuffix(".")
    if host == bind_host.lower():
        return True
    local = host in LOOPBACK_NAMES or _is_loopback(host)
    if _is_loopback(bind_host):
        return local or host in WILDCARD_HOSTS  # a connect to 0.0.0.0 or :: reaches this machine
    if bind_host in WILDCARD_HOSTS:
        return local or host in WILDCARD_HOSTS or host in own_hosts
    return False


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (Python 3.11 does not unwrap it)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
