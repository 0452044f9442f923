"""Who may call what: API keys, the caller's address and the access verdict. Pure, stdlib only.

The router's keys and access rules copy hugpy-wrapper's (contracts/hugpy-wrapper.md §6) under
the router's own settings (`HUGPY_ROUTER_KEY`, `HUGPY_ROUTER_REQUIRE_KEY`,
`HUGPY_ROUTER_TRUSTED_NETS`, `HUGPY_ROUTER_TRUSTED_PROXIES`). Setting values and times come in
as arguments: nothing here reads the environment, the clock or the store.

Keys:
1. A key is `hpk_<id>_<secret>`. It splits on the first `_` after the prefix, so the id holds
   no `_` and the secret may. An empty id or secret is not a key.
2. Only `sha256(secret_utf8)` is stored (no salt, no pepper, as hugpy), and hashes are compared
   in constant time (`hmac.compare_digest`) by the key store.

The caller's address (`client_address`):
3. If any of `X-Forwarded-For`, `Forwarded`, `X-Real-IP` is present, the peer must be a trusted
   proxy; otherwise the caller is unknown (None), which counts as outside and not loopback.
4. From a trusted proxy, `X-Forwarded-For` is walked right to left, skipping trusted proxies;
   the first other hop is the caller, and an unparsable hop makes the caller unknown. When
   every hop is a trusted proxy (or only `Forwarded`/`X-Real-IP` was sent), the peer is the
   caller. `Forwarded` and `X-Real-IP` are never read for the address, only noticed.
5. IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) are compared as IPv4.

Access (`decide_access`), in this order:
6. Use routes: mode `never` lets everyone in; `outside` (the default) lets inside callers in
   without looking at the key at all, so a bad key from inside passes (as hugpy); `always`, and
   an outside caller under `outside`, need a valid key of either scope.
7. Admin routes: loopback (or a caller equal to the connection's own local address) manages
   without a key in every mode, `always` included (hugpy's quirk); anyone else needs an admin
   key. The trusted nets never apply to admin routes.
8. A missing key is 401 `invalid_api_key` ("required from here"); an invalid, expired or
   revoked key is 401 `invalid_api_key`; a valid use key on an admin route is 403
   `insufficient_scope`.
9. `require_key_mode`: unset or empty is `outside`; any unknown value is `always` (a typo
   fails closed).
10. "Inside" is the default private nets plus `HUGPY_ROUTER_TRUSTED_NETS`: the setting widens
    the defaults (hugpy's own setting replaces them; the router's issue says widen).
    `HUGPY_ROUTER_TRUSTED_PROXIES` defaults to none.
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Callable, Literal, NamedTuple

from router.core.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Mode = Literal["never", "outside", "always"]
Scope = Literal["use", "admin"]

KEY_PREFIX = "hpk_"
MODES: frozenset[str] = frozenset({"never", "outside", "always"})
DEFAULT_MODE: Mode = "outside"

# hugpy-wrapper constants.py:212-213: loopback, the RFC 1918 nets, IPv6 ULA and link-local.
DEFAULT_TRUSTED_NETS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
        "fd00::/8", "fe80::/10",
    )
)

# Any of these means a proxy stands between the peer and the caller (rule 3).
FORWARDED_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")

# The client-visible texts, word for word hugpy's (auth.py:98-99, 240-248), except that the
# router, not a box, is what an admin key manages.
MSG_KEY_REQUIRED = "an API key is required from here: send Authorization: Bearer hpk_…"
MSG_KEY_INVALID = "invalid, expired or revoked API key"
MSG_SCOPE_USE = "this key cannot manage the router (scope use); an admin key is needed"
CODE_INVALID_KEY = "invalid_api_key"
CODE_INSUFFICIENT_SCOPE = "insufficient_scope"


class Verdict(NamedTuple):
    ok: bool
    status: int
    code: str
    message: str


ALLOW = Verdict(True, 200, "", "")
KEY_REQUIRED = Verdict(False, 401, CODE_INVALID_KEY, MSG_KEY_REQUIRED)
KEY_INVALID = Verdict(False, 401, CODE_INVALID_KEY, MSG_KEY_INVALID)
SCOPE_TOO_NARROW = Verdict(False, 403, CODE_INSUFFICIENT_SCOPE, MSG_SCOPE_USE)


# --- keys -------------------------------------------------------------------------------------


def parse_key(bearer: str) -> tuple[str, str] | None:
    """Returns (id, secret) for `hpk_<id>_<secret>` (rule 1), or None when it is not a key."""
    if not bearer.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = bearer[len(KEY_PREFIX):].partition("_")
    if not sep or not key_id or not secret:
        return None
    return key_id, secret


def hash_secret(secret: str) -> str:
    """Returns the stored form of a secret: sha256 hex of its UTF-8 bytes (rule 2)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    """Returns the key in an `Authorization: Bearer <key>` value (prefix case-insensitive, as
    hugpy auth.py:93-95), or None when there is none."""
    if authorization is None or authorization[:7].lower() != "bearer ":
        return None
    token = authorization[7:].strip()
    return token or None


# --- settings ---------------------------------------------------------------------------------


def require_key_mode(value: str | None) -> Mode:
    """Returns the mode for a `HUGPY_ROUTER_REQUIRE_KEY` value (rule 9)."""
    if value is None or not value.strip():
        return DEFAULT_MODE
    mode = value.strip().lower()
    return mode if mode in MODES else "always"  # type: ignore[return-value]


def parse_nets(value: str | None, setting: str) -> tuple[Network, ...]:
    """Returns the networks in a comma list of IPs or CIDRs (host bits allowed).

    Raises ConfigError naming `setting` and the bad entry: a silently dropped entry would
    either lock out or let in someone the operator did not mean to.
    """
    nets: list[Network] = []
    for entry in (value or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(f"{setting}: {entry!r} is not an IP address or CIDR") from None
    return tuple(nets)


def inside_nets(value: str | None) -> tuple[Network, ...]:
    """Returns the nets that count as inside: the defaults plus `HUGPY_ROUTER_TRUSTED_NETS`
    (rule 10). Raises ConfigError for a bad entry."""
    return DEFAULT_TRUSTED_NETS + parse_nets(value, "HUGPY_ROUTER_TRUSTED_NETS")


def proxy_nets(value: str | None) -> tuple[Network, ...]:
    """Returns the trusted proxies in `HUGPY_ROUTER_TRUSTED_PROXIES` (default none). Raises
    ConfigError for a bad entry."""
    return parse_nets(value, "HUGPY_ROUTER_TRUSTED_PROXIES")


# --- addresses --------------------------------------------------------------------------------


def _ip(text: str | None) -> Address | None:
    """The address in `text`, IPv4-mapped IPv6 unwrapped (rule 5); None when unparsable."""
    if not text:
        return None
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _in(ip: Address, nets: tuple[Network, ...] | list[Network]) -> bool:
    # `in` across versions is simply False, so mixed IPv4/IPv6 lists need no sorting.
    return any(ip in net for net in nets)


def client_address(
    peer: str | None,
    headers: Callable[[str], str | None],
    trusted_proxies: tuple[Network, ...] | list[Network],
) -> str | None:
    """Returns the caller's address (rules 3-5), or None when the caller is unknown.

    `peer` is the connection's remote address; `headers(name)` returns a header's value by
    lower-case name (repeated `X-Forwarded-For` lines joined with `,`), or None.
    """
    peer_ip = _ip(peer)
    if not any(headers(name) is not None for name in FORWARDED_HEADERS):
        return None if peer_ip is None else str(peer_ip)
    if peer_ip is None or not _in(peer_ip, trusted_proxies):
        return None
    forwarded_for = headers("x-forwarded-for")
    if forwarded_for is not None:
        for hop in reversed(forwarded_for.split(",")):
            hop_ip = _ip(hop)
            if hop_ip is None:
                return None
            if not _in(hop_ip, trusted_proxies):
                return str(hop_ip)
    return str(peer_ip)


def is_inside(addr: str | None, trusted_nets: tuple[Network, ...] | list[Network]) -> bool:
    """True when `addr` lies in one of `trusted_nets`; an unknown caller is never inside."""
    ip = _ip(addr)
    return ip is not None and _in(ip, trusted_nets)


def is_loopback(addr: str | None, local_addr: str | None = None) -> bool:
    """True when `addr` is a loopback address, or equals `local_addr` (the connection's own
    address, when it is not the unspecified one: a client on the router's own machine that
    reached it by its LAN address). An unknown caller is never loopback."""
    ip = _ip(addr)
    if ip is None:
        return False
    if ip.is_loopback:
        return True
    local = _ip(local_addr)
    return local is not None and not local.is_unspecified and ip == local


# --- the verdict ------------------------------------------------------------------------------


def decide_access(
    route_scope: Scope,
    mode: Mode,
    addr: str | None,
    key_scope: Scope | None,
    key_presented: bool,
    trusted_nets: tuple[Network, ...] | list[Network],
    *,
    local_addr: str | None = None,
) -> Verdict:
    """Returns the verdict for one request (rules 6-8).

    `addr` is `client_address(...)` (None = unknown); `key_scope` is what the key store said
    of the presented key (None when missing or invalid); `key_presented` tells a missing key
    from an invalid one. Passing a `route_scope` or `mode` outside their literals is a bug.
    """
    if route_scope == "admin":
        if is_loopback(addr, local_addr):
            return ALLOW
        if key_scope == "admin":
            return ALLOW
        if key_scope == "use":
            return SCOPE_TOO_NARROW
        return KEY_INVALID if key_presented else KEY_REQUIRED
    if mode == "never" or (mode == "outside" and is_inside(addr, trusted_nets)):
        return ALLOW
    if key_scope is not None:
        return ALLOW
    return KEY_INVALID if key_presented else KEY_REQUIRED
