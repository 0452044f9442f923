"""Who may call what: API keys, the caller's address and the access verdict. Pure, stdlib only.

The router's keys and access rules copy hugpy-wrapper's (contracts/hugpy-wrapper.md §6) under
the router's own settings (`HUGPY_ROUTER_KEY`, `HUGPY_ROUTER_REQUIRE_KEY`,
`HUGPY_ROUTER_TRUSTED_NETS`, `HUGPY_ROUTER_TRUSTED_PROXIES`, `HUGPY_ROUTER_ALLOWED_HOSTS`,
`HUGPY_ROUTER_ALLOWED_ORIGINS`). Setting values and times come in as arguments: nothing here
reads the environment, the clock or the store.

Keys:
1. A key is `hpk_<id>_<secret>`. It splits on the first `_` after the prefix, so the id holds
   no `_` and the secret may. An empty id or secret is not a key.
1a. A key is read only from `Authorization: Bearer` (any other scheme, such as the `Basic` of a
   proxy in front, and any other header, such as `x-api-key`, is no key). A bearer value in the
   key's form (`hpk_…`, valid or not) or an empty one (a key variable left empty) is a presented
   key (`presents_key`), judged in every mode (rule 10). Any other value is a client's
   placeholder, since the `openai` client cannot send no key and local tools send `x`, `ollama`
   or `lm-studio`: it passes where no key is needed, so it gets nothing a keyless call does not,
   and is an invalid key where one is. `HUGPY_ROUTER_KEY`, whatever its form, is valid as sent.
2. Only `sha256(secret_utf8)` is stored (no salt, no pepper, as hugpy), and hashes are compared
   in constant time (`hmac.compare_digest`) by the key store.

The caller (`client_address`, returning a `Caller`):
3. With no forwarding header (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`), the caller is the
   TCP peer, unless that is a trusted proxy (rule 4). A forwarding header from a peer that is not a trusted proxy is never read for the
   address, and its presence makes the caller unknown (None): outside, not loopback. Why not
   simply the peer: a reverse proxy the operator forgot to list in
   `HUGPY_ROUTER_TRUSTED_PROXIES` would otherwise make every caller loopback.
4. From a trusted proxy, the first of `X-Forwarded-For` (every line, joined in order),
   `Forwarded` (RFC 7239 `for=`) and `X-Real-IP` that is present and not blank gives the hops,
   left (client) to right (nearest proxy). They are walked right to left, skipping trusted
   proxies; the first other hop is the caller (the right-most untrusted hop: what the nearest
   trusted proxy saw, since everything left of it is the client's to write, as nginx's
   `real_ip_recursive` and Envoy's trusted hops). A hop that does not parse (`unknown`, an
   obfuscated `_name`, garbage, a `Forwarded` element without `for=`) ends the walk with an
   unknown caller; so does running out of hops, or having none. The caller is therefore never a
   trusted proxy, and a trusted proxy that forwards no parseable address is outside.
5. A hop or peer is `a.b.c.d`, `a.b.c.d:port`, an IPv6 address, or `[v6]` with an optional
   `:port`, surrounding whitespace ignored, a `Forwarded` value quoted or not. IPv4-mapped IPv6
   (`::ffff:a.b.c.d`) is compared as IPv4. ASGI gives the peer as `::1`, RSGI as `[::1]:port`:
   both go through `peer_address`, so the two interfaces judge alike.
6. A caller resolved through a trusted proxy is `via_proxy`: it is judged by its address for
   use routes, but never counts as loopback (a `127.0.0.1` written by a proxy on another host
   is that host, not this one).

Access (`decide_access`), in this order:
7. Public routes (the liveness probes) are open to everyone in every mode.
8. Use routes (inference, listings, metrics):
   a. a browser's `Origin` must be the router's own or allowed, as rule 9a, whatever the key:
      a cross-site page may not post to a box through the router (issue 20 item 1).
   b. a presented key that is not valid is refused in every mode, from every caller (rule 10;
      hugpy lets a bad key from inside pass): a key revoked on one router is refused by every
      router, and a mistyped one fails on the laptop as it would from outside. Then mode
      `never` lets everyone in; `outside` (the default) lets inside callers in without a key;
      `always`, and an outside caller under `outside`, need a valid key of either scope.
   c. a call served without a valid key needs a `Host` that a rebound page cannot send
      (`serves_host`): none, an IP literal, a loopback name, a name that public DNS never
      answers (a single label such as `gpu-box`, which only the hosts file or a local search
      domain resolves, or a name under `.localhost`, `.local`, `.internal`, as Ollama's own
      check), one of this machine's names, or one of `HUGPY_ROUTER_ALLOWED_HOSTS`. Otherwise
      403 `host_not_allowed` (DNS rebinding, issue 20 item 2); with a valid key, any Host.
9. Admin routes (the router's own API and engine management on the facades):
   a. a browser's `Origin` must be the router's own (its host and port are the request's
      `Host`) or one of `HUGPY_ROUTER_ALLOWED_ORIGINS`; no `Origin` is a client that is not a
      browser. Otherwise 403 `origin_not_allowed`, whatever the key.
   b. an admin key is served, whatever the Host; a presented key that is not valid is refused,
      loopback included (rule 10);
   c. a direct loopback caller (or one equal to the connection's own local address) manages
      without a key in every mode, `always` included (hugpy's quirk), but only when `Host`
      names the router: `localhost`, a loopback address, or one of
      `HUGPY_ROUTER_ALLOWED_HOSTS`. Otherwise a keyless one gets 403 `host_not_allowed`: a
      page whose name was rebound to 127.0.0.1 (DNS rebinding) sends its own name as Host.
   d. anyone else needs an admin key. The trusted nets never apply to admin routes.
10. Where a key is needed, a missing one is 401 `invalid_api_key` ("required from here") and a
    placeholder (rule 1a) is 401 `invalid_api_key` ("invalid"). A presented key that is unknown,
    expired, revoked or malformed is 401 `invalid_api_key` on every route but the public ones
    (the probes, the dashboard page), whatever the mode and the caller. A valid use key on an
    admin route is 403 `insufficient_scope` where loopback does not manage (rule 9c).
11. An admin route that takes a JSON body refuses any other `Content-Type` with 415 (a form or
    `text/plain` POST is what a browser may send cross-site without asking first).
12. `require_key_mode`: unset or empty is `outside`; any unknown value is `always` (a typo
    fails closed).
13. "Inside" is the default private nets plus `HUGPY_ROUTER_TRUSTED_NETS`: the setting widens
    the defaults (hugpy's own setting replaces them; the router's issue says widen).
    `HUGPY_ROUTER_TRUSTED_PROXIES` defaults to none.

A balancer not listed (`SoleCaller`):
14. With no trusted proxy, a balancer or proxy in front makes every caller its own address: on
    a LAN address every Internet caller is inside, and all of them are one caller for the queue
    share, `--default-rpm` and affinity. So when the first SOLE_CALLER_CALLS judged calls all
    come from one inside, non-loopback address, that is said once; a call from any other
    address (or an unknown one) ends the watch. Loopback alone is a workstation's normal case.
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import Callable, Literal, NamedTuple

from router.core.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Mode = Literal["never", "outside", "always"]
Scope = Literal["public", "use", "admin"]
KeyScope = Literal["use", "admin"]

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

# Any of these means a proxy stands between the peer and the caller (rule 3), read in this
# order (rule 4).
FORWARDED_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")
# Host names that are this machine whatever DNS says (rule 9c); loopback addresses also count.
LOOPBACK_NAMES = frozenset({"localhost"})
# Top-level domains that public DNS never answers, so no page's name under them can be rebound
# from outside (rule 8c; Ollama's allowedHost list; `localhost` itself is a single label): RFC 6761's `localhost`, mDNS's `local`,
# and `internal`, which ICANN keeps for private use (2024).
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
DEFAULT_PORTS = {"http": "80", "https": "443"}

# The client-visible texts, word for word hugpy's (auth.py:98-99, 240-248), except that the
# router, not a box, is what an admin key manages.
MSG_KEY_REQUIRED = "an API key is required from here: send Authorization: Bearer hpk_…"
MSG_KEY_INVALID = "invalid, expired or revoked API key"
MSG_SCOPE_USE = "this key cannot manage the router (scope use); an admin key is needed"
MSG_ORIGIN = (
    "this Origin may not manage the router: only the router's own pages and the origins in "
    "HUGPY_ROUTER_ALLOWED_ORIGINS may"
)
MSG_HOST = (
    "managing the router without a key needs a Host that names it (localhost, 127.x, [::1] or "
    "one of HUGPY_ROUTER_ALLOWED_HOSTS); or send an admin key"
)
MSG_USE_ORIGIN = (
    "this Origin may not call the router: only the router's own pages and the origins in "
    "HUGPY_ROUTER_ALLOWED_ORIGINS may"
)
MSG_USE_HOST = (
    "a call without a key needs a Host that names this router (an IP address, localhost, this "
    "machine's name or one of HUGPY_ROUTER_ALLOWED_HOSTS); or send a key"
)
MSG_NOT_JSON = "this route takes a JSON body: send Content-Type: application/json"
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
ORIGIN_REFUSED = Verdict(False, 403, "origin_not_allowed", MSG_ORIGIN)
HOST_REFUSED = Verdict(False, 403, "host_not_allowed", MSG_HOST)
USE_ORIGIN_REFUSED = Verdict(False, 403, "origin_not_allowed", MSG_USE_ORIGIN)
USE_HOST_REFUSED = Verdict(False, 403, "host_not_allowed", MSG_USE_HOST)
NOT_JSON = Verdict(False, 415, "unsupported_media_type", MSG_NOT_JSON)


class Caller(NamedTuple):
    """Who is calling (rules 3-6): `addr` None is unknown (outside); `via_proxy` when a trusted
    proxy named it."""

    addr: str | None
    via_proxy: bool


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
    """Returns the value in an `Authorization: Bearer <key>` header (scheme case-insensitive, as
    hugpy auth.py:93-95): "" for a `Bearer` without one (the server may have trimmed the space),
    None for no header or another scheme (rule 1a)."""
    if authorization is None:
        return None
    value = authorization.strip()
    if value[:6].lower() != "bearer" or value[6:7] not in ("", " "):
        return None
    return value[6:].strip()


def presents_key(bearer: str | None) -> bool:
    """True when a bearer value (`bearer_token`'s) is a presented key, judged in every mode
    (rule 1a): one in the key's form, valid or not, or an empty one. False for none and for a
    client's placeholder (`x`, `ollama`, `lm-studio`)."""
    return bearer is not None and (not bearer or bearer.startswith(KEY_PREFIX))


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


def allowed_hosts(value: str | None) -> frozenset[str]:
    """Returns the extra names in `HUGPY_ROUTER_ALLOWED_HOSTS` (comma list; a port, brackets,
    case and a trailing dot are ignored) under which keyless loopback may manage (rule 9c)."""
    return frozenset(name for entry in (value or "").split(",") if (name := host_name(entry)))


def allowed_origins(value: str | None) -> frozenset[str]:
    """Returns the origins in `HUGPY_ROUTER_ALLOWED_ORIGINS` (comma list of
    `scheme://host[:port]`), normalised as `_origin` does (rule 9a).

    Raises ConfigError naming the entry that is not an http(s) origin.
    """
    origins = set()
    for entry in (value or "").split(","):
        if not entry.strip():
            continue
        origin = _origin(entry.strip().rstrip("/"))
        if origin is None:
            raise ConfigError(f"HUGPY_ROUTER_ALLOWED_ORIGINS: {entry.strip()!r} is not an http(s) origin")
        origins.add(origin)
    return frozenset(origins)


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


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5


def _node(text: str) -> Address | None:
    """The address of one hop or peer (rule 5): `a.b.c.d[:port]`, a bare IPv6 address, or
    `[v6][:port]`; None for anything else."""
    text = text.strip()
    if text.startswith("["):
        inside, sep, rest = text[1:].partition("]")
        if not sep or (rest and not (rest[0] == ":" and _is_port(rest[1:]))) or ":" not in inside:
            return None
        return _ip(inside)
    host, sep, port = text.partition(":")
    if sep and ":" not in port:  # exactly one colon: IPv4 with a port
        return _ip(host) if _is_port(port) and "." in host else None
    return _ip(text)


def peer_address(peer: str) -> str:
    """The address in a peer given as `a.b.c.d:port` or `[v6]:port` (RSGI's form), as ASGI gives
    it (`a.b.c.d`, `v6`), so both interfaces judge alike (rule 5). String work only: the address
    is parsed when it is judged."""
    if peer.startswith("["):
        return peer[1:].partition("]")[0]
    if peer.count(":") == 1:
        return peer.partition(":")[0]
    return peer


def _in(ip: Address, nets: tuple[Network, ...] | list[Network]) -> bool:
    # `in` across versions is simply False, so mixed IPv4/IPv6 lists need no sorting.
    return any(ip in net for net in nets)


def _split_unquoted(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside RFC 9110 quoted strings (a backslash escapes one char)."""
    parts: list[str] = []
    start, quoted, escaped = 0, False, False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _unquote(value: str) -> str | None:
    """A `Forwarded` value: a token as is, a quoted string without its quotes and escapes;
    None when the quotes do not close."""
    if not value.startswith('"'):
        return value
    if len(value) < 2 or not value.endswith('"'):
        return None
    out, escaped = [], False
    for char in value[1:-1]:
        if escaped or char != "\\":
            out.append(char)
            escaped = False
        else:
            escaped = True
    return None if escaped else "".join(out)


def forwarded_for(value: str) -> list[str | None]:
    """The `for=` node of each element of an RFC 7239 `Forwarded` value, left to right, unquoted;
    None for an element without one (or with broken quoting)."""
    hops: list[str | None] = []
    for element in _split_unquoted(value, ","):
        if not element.strip():
            continue  # an empty list element (RFC 9110 §5.6.1)
        found: str | None = None
        for pair in _split_unquoted(element, ";"):
            name, sep, raw = pair.partition("=")
            if sep and name.strip().lower() == "for":
                found = _unquote(raw.strip())
                break
        hops.append(found)
    return hops


def _hops(name: str, value: str) -> list[str | None]:
    if name == "forwarded":
        return forwarded_for(value)
    return [hop for hop in value.split(",") if hop.strip()]


def client_address(
    peer: str | None,
    headers: Callable[[str], str | None],
    trusted_proxies: tuple[Network, ...] | list[Network],
) -> Caller:
    """Returns who is calling (rules 3-6); its `addr` is None when the caller is unknown.

    `peer` is the connection's remote address (any form `peer_address` takes); `headers(name)`
    returns a header by lower-case name, every line of it joined with `,` in order, or None.
    Never raises on any header content.
    """
    peer_ip = _node(peer) if peer else None
    values = [(name, headers(name)) for name in FORWARDED_HEADERS]
    trusted = peer_ip is not None and _in(peer_ip, trusted_proxies)
    if not trusted:
        if peer_ip is None or any(value is not None for _, value in values):
            return Caller(None, False)
        return Caller(str(peer_ip), False)
    for name, value in values:
        if value is not None and value.strip():
            for hop in reversed(_hops(name, value)):
                hop_ip = None if hop is None else _node(hop)
                if hop_ip is None:
                    break
                if not _in(hop_ip, trusted_proxies):
                    return Caller(str(hop_ip), True)
            break
    return Caller(None, True)


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


# --- what a browser sends ---------------------------------------------------------------------


def host_name(host: str | None) -> str | None:
    """The name in a `Host` value: lower case, without port, brackets or a trailing dot; None
    when there is none."""
    if host is None:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        name = host.partition(":")[0]
    else:
        name = host  # a bare name, or an IPv6 address without brackets
    return name.rstrip(".") or None


def names_router(host: str | None, allowed: frozenset[str]) -> bool:
    """True when a `Host` value names this router (rule 9c): `localhost`, a loopback address,
    or one of `allowed` (`allowed_hosts`)."""
    name = host_name(host)
    if name is None:
        return False
    if name in LOOPBACK_NAMES or name in allowed:
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


def serves_host(host: str | None, names: frozenset[str]) -> bool:
    """True when a use call without a valid key may be served under this `Host` (rule 8c):
    none sent, an IP literal, a loopback or local name, or one of `names` (this machine's own
    and `allowed_hosts`, as `host_name` gives them)."""
    if host is None:
        return True  # HTTP/1.0 without Host: no browser sends that
    name = host_name(host)
    if name is None:
        return False
    if "." not in name or name in names or name.endswith(LOCAL_SUFFIXES):
        return True  # (a bare IPv6 address has no dot either: it is an IP literal)
    return _ip(name) is not None


def _origin(text: str) -> str | None:
    """`scheme://host[:port]` lower-cased, without a default port; None unless http(s)."""
    scheme, sep, authority = text.strip().lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or not authority or "/" in authority or "@" in authority:
        return None
    name, port = authority, ""
    if authority.startswith("["):
        end = authority.find("]")
        if end > 0 and authority[end + 1:end + 2] == ":":
            name, port = authority[:end + 1], authority[end + 2:]
    elif authority.count(":") == 1:
        name, _, port = authority.partition(":")
    if port == DEFAULT_PORTS[scheme]:
        port = ""
    return f"{scheme}://{name}" + (f":{port}" if port else "")


def origin_allowed(origin: str | None, host: str | None, allowed: frozenset[str]) -> bool:
    """True when a request may manage as far as its `Origin` goes (rule 9a): none sent, the
    router's own (the origin's authority is the request's `Host`), or one of `allowed`."""
    if origin is None:
        return True
    normal = _origin(origin)
    if normal is None:
        return False  # `null` (a sandboxed or file page) and anything else malformed
    if normal in allowed:
        return True
    if host is None:
        return False
    scheme = normal.partition("://")[0]
    return normal == _origin(f"{scheme}://{host.strip()}")


def is_json(content_type: str | None) -> bool:
    """True when a `Content-Type` is `application/json`, parameters ignored (rule 11)."""
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"


# --- a balancer not listed (rule 14) ----------------------------------------------------------

# Enough calls that one client trying the router is not taken for a balancer.
SOLE_CALLER_CALLS = 200


class SoleCaller:
    """Watches the first calls' addresses (rule 14). `see` returns True once, on the call that
    makes SOLE_CALLER_CALLS from one inside, non-loopback address; `over` is True once the watch
    has ended either way, and the caller may drop it."""

    __slots__ = ("addr", "calls", "over")

    def __init__(self) -> None:
        self.addr: str | None = None
        self.calls = 0
        self.over = False

    def see(self, addr: str | None, inside: bool) -> bool:
        """One judged call from `addr` (`inside`: it lies in the inside nets)."""
        if self.calls == 0:
            if not inside or is_loopback(addr):
                self.over = True
                return False
            self.addr = addr
        elif addr != self.addr:
            self.over = True
            return False
        self.calls += 1
        if self.calls < SOLE_CALLER_CALLS:
            return False
        self.over = True
        return True


# --- the verdict ------------------------------------------------------------------------------


def decide_access(
    route_scope: Scope,
    mode: Mode,
    addr: str | None,
    key_scope: KeyScope | None,
    key_presented: bool,
    trusted_nets: tuple[Network, ...] | list[Network],
    *,
    via_proxy: bool,
    router_host: bool,
    origin_ok: bool,
    host_served: bool = True,
    local_addr: str | None = None,
    placeholder: bool = False,
) -> Verdict:
    """Returns the verdict for one request (rules 7-10).

    `addr` and `via_proxy` are `client_address(...)`'s; `key_scope` is what the key store said
    of the bearer value (None when missing or invalid); `key_presented` tells a missing value
    from an invalid one, and `placeholder` (not `presents_key`) an invalid value that is refused
    only where a key is needed from one refused everywhere (rule 1a). `origin_ok`
    (`origin_allowed`) matters for use and admin routes, `router_host` (`names_router`) for
    admin routes, `host_served` (`serves_host`) for use routes. Passing a `route_scope` or
    `mode` outside their literals is a bug.
    """
    if route_scope == "public":
        return ALLOW
    bad_key = key_presented and key_scope is None and not placeholder
    if route_scope == "admin":
        if not origin_ok:
            return ORIGIN_REFUSED
        if key_scope == "admin":
            return ALLOW
        if bad_key:
            return KEY_INVALID  # loopback included (rule 9b)
        local = not via_proxy and is_loopback(addr, local_addr)
        if local and router_host:
            return ALLOW
        if key_scope == "use":
            return SCOPE_TOO_NARROW
        if key_presented:
            return KEY_INVALID  # a placeholder where a key is needed
        return HOST_REFUSED if local else KEY_REQUIRED
    if not origin_ok:
        return USE_ORIGIN_REFUSED
    if bad_key:
        return KEY_INVALID  # in every mode, inside callers included (rule 8b)
    keyless = mode == "never" or (mode == "outside" and is_inside(addr, trusted_nets))
    if keyless and host_served:
        return ALLOW
    if key_scope is not None:
        return ALLOW
    if keyless:
        return USE_HOST_REFUSED
    return KEY_INVALID if key_presented else KEY_REQUIRED
