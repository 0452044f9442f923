"""Keys and access (router/core/access.py): one test per rule of its docstring, as tables, plus
property tests where a rule holds for every input (key round-trip, spoofed forwarding)."""

from __future__ import annotations

import ast
import hashlib
import ipaddress
import string
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core import access
from router.core.access import (
    ALLOW,
    DEFAULT_TRUSTED_NETS,
    HOST_REFUSED,
    KEY_INVALID,
    KEY_REQUIRED,
    NOT_JSON,
    ORIGIN_REFUSED,
    SCOPE_TOO_NARROW,
    USE_HOST_REFUSED,
    USE_ORIGIN_REFUSED,
    Caller,
    Verdict,
    allowed_hosts,
    allowed_origins,
    bearer_token,
    client_address,
    decide_access,
    hash_secret,
    inside_nets,
    is_inside,
    is_json,
    is_loopback,
    names_router,
    origin_allowed,
    parse_key,
    peer_address,
    presents_key,
    proxy_nets,
    require_key_mode,
    serves_host,
)
from router.core.errors import ConfigError
from router.serve.access import AccessGate
from router.serve.edge import AsgiEdge
from router.store.keys import KeyStore

URLSAFE = string.ascii_letters + string.digits + "-_"
NETS = inside_nets(None)
# A direct caller whose Host names the router and who sent no foreign Origin.
DIRECT_OK = {"via_proxy": False, "router_host": True, "origin_ok": True}


def hdrs(**values: str):
    """A header lookup by lower-case name, as the serve room passes it."""
    table = {name.replace("_", "-"): value for name, value in values.items()}
    return table.get


# --- keys (rules 1-2) -------------------------------------------------------------------------


@given(
    key_id=st.text(alphabet="0123456789abcdef", min_size=1, max_size=12),
    secret=st.text(alphabet=URLSAFE, min_size=1, max_size=64),
)
def test_parse_key_round_trips_secrets_with_underscores(key_id, secret):
    assert parse_key(f"hpk_{key_id}_{secret}") == (key_id, secret)


@given(secret=st.text(min_size=1))
def test_hash_secret_is_unsalted_sha256_of_utf8(secret):
    assert hash_secret(secret) == hashlib.sha256(secret.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    "bearer, expected",
    [
        ("hpk_ab12_s3cr_et", ("ab12", "s3cr_et")),
        ("hpk_ab12__lead", ("ab12", "_lead")),
        ("hpk_ab12", None),  # no secret
        ("hpk__secret", None),  # empty id
        ("hpk_ab12_", None),  # empty secret
        ("HPK_ab12_secret", None),  # the prefix is exact
        ("sk-ab12_secret", None),
        ("", None),
    ],
)
def test_parse_key_table(bearer, expected):
    assert parse_key(bearer) == expected


@pytest.mark.parametrize(
    "header, expected",
    [
        ("Bearer hpk_a_b", "hpk_a_b"),
        ("bearer hpk_a_b", "hpk_a_b"),
        ("BEARER  hpk_a_b ", "hpk_a_b"),
        ("Basic abc", None),  # another scheme (a proxy's own login) is no key (rule 1a)
        ("Bearer ", ""),  # an empty key variable: presented, and malformed
        ("Bearer", ""),  # the same, its trailing space trimmed on the way
        ("Bearerhpk_a_b", None),
        (None, None),
    ],
)
def test_bearer_token(header, expected):
    assert bearer_token(header) == expected


@pytest.mark.parametrize(
    "bearer, presented",
    [
        ("hpk_ab12_secret", True), ("hpk_revoked_or_mistyped", True), ("hpk_ab12", True),  # malformed
        ("", True),  # an empty Bearer
        ("x", False), ("ollama", False), ("lm-studio", False), ("sk-no-key-required", False),  # placeholders
        ("HPK_ab12_secret", False), (None, False),
    ],
)
def test_presents_key(bearer, presented):
    """Rule 1a: what is judged in every mode; a placeholder the openai client must send is not."""
    assert presents_key(bearer) is presented


# --- the caller (rules 3-6) -------------------------------------------------------------------

PROXY = proxy_nets("127.0.0.1, 10.9.0.0/16")
DIRECT, VIA = False, True


@pytest.mark.parametrize(
    "peer, headers, proxies, expected",
    [
        # No forwarding headers: the peer is the caller, as ASGI or RSGI gives it (rule 5).
        ("203.0.113.9", {}, (), ("203.0.113.9", DIRECT)),
        ("::ffff:192.168.1.4", {}, (), ("192.168.1.4", DIRECT)),
        ("::1", {}, (), ("::1", DIRECT)),
        ("not-an-ip", {}, (), (None, DIRECT)),
        # Spoofed: any forwarding header from an untrusted peer makes the caller unknown.
        ("192.168.1.4", {"x_forwarded_for": "127.0.0.1"}, (), (None, DIRECT)),
        ("127.0.0.1", {"x_forwarded_for": "127.0.0.1"}, (), (None, DIRECT)),
        ("192.168.1.4", {"x_real_ip": "127.0.0.1"}, PROXY, (None, DIRECT)),
        ("192.168.1.4", {"forwarded": "for=127.0.0.1"}, PROXY, (None, DIRECT)),
        ("192.168.1.4", {"x_forwarded_for": ""}, PROXY, (None, DIRECT)),
        # Trusted proxy: XFF right to left, skipping trusted proxies (hugpy's [run] cases).
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5, 127.0.0.1"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "198.51.100.1, 203.0.113.5, 10.9.3.3"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "::ffff:203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5:4711"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "[2001:db8::1]:4711"}, PROXY, ("2001:db8::1", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "2001:db8::1"}, PROXY, ("2001:db8::1", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5,,"}, PROXY, ("203.0.113.5", VIA)),  # empty elements
        ("::ffff:127.0.0.1", {"x_forwarded_for": "203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        # ... and never the proxy itself: no parseable forwarded address is outside (rule 4).
        ("127.0.0.1", {}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "127.0.0.1"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "10.9.1.1, 127.0.0.1"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "garbage, 10.9.3.3"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5, garbage"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5:99999999"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "1.2.3.4:"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"x_forwarded_for": "[1.2.3.4]"}, PROXY, (None, VIA)),
        # Forwarded (RFC 7239): for=, quoted, IPv6 in brackets, ports, several elements.
        ("127.0.0.1", {"forwarded": "for=203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"forwarded": 'For="[2001:db8:cafe::17]:4711";proto=https'}, PROXY, ("2001:db8:cafe::17", VIA)),
        ("127.0.0.1", {"forwarded": 'for="203.0.113.5:47011"'}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"forwarded": "for=198.51.100.1, for=203.0.113.5;by=10.9.0.1, for=10.9.2.2"}, PROXY,
         ("203.0.113.5", VIA)),
        ("127.0.0.1", {"forwarded": 'for="a,b;c", for=203.0.113.5'}, PROXY, ("203.0.113.5", VIA)),  # quoted , and ;
        ("127.0.0.1", {"forwarded": "for=unknown"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"forwarded": "for=_hidden"}, PROXY, (None, VIA)),
        ("127.0.0.1", {"forwarded": "proto=https;by=10.9.0.1"}, PROXY, (None, VIA)),  # no for=
        ("127.0.0.1", {"forwarded": 'for="203.0.113.5'}, PROXY, (None, VIA)),  # quote never closes
        ("127.0.0.1", {"forwarded": "for=[2001:db8::1]"}, PROXY, ("2001:db8::1", VIA)),
        # X-Real-IP, last.
        ("127.0.0.1", {"x_real_ip": "203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_real_ip": "127.0.0.1"}, PROXY, (None, VIA)),
        # Order: the first present, non-blank header decides; a later one is not a fallback.
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5", "forwarded": "for=198.51.100.1"}, PROXY,
         ("203.0.113.5", VIA)),
        ("127.0.0.1", {"forwarded": "for=198.51.100.1", "x_real_ip": "203.0.113.5"}, PROXY, ("198.51.100.1", VIA)),
        ("127.0.0.1", {"x_forwarded_for": " ", "x_real_ip": "203.0.113.5"}, PROXY, ("203.0.113.5", VIA)),
        ("127.0.0.1", {"x_forwarded_for": "garbage", "x_real_ip": "203.0.113.5"}, PROXY, (None, VIA)),
    ],
)
def test_client_address_table(peer, headers, proxies, expected):
    assert client_address(peer, hdrs(**headers), proxies) == Caller(*expected)


@pytest.mark.parametrize(
    "peer, address",
    [("127.0.0.1:5000", "127.0.0.1"), ("[::1]:5000", "::1"), ("[2001:db8::1]:80", "2001:db8::1"),
     ("::1", "::1"), ("127.0.0.1", "127.0.0.1")],
)
def test_peer_address_takes_rsgi_and_asgi_forms_alike(peer, address):
    assert peer_address(peer) == address


PROXIES = proxy_nets("10.9.0.0/16, 127.0.0.1, fd00::7")
HOP_ADDRESSES = ["127.0.0.1", "10.9.3.3", "fd00::7", "192.168.1.9", "203.0.113.5", "::1", "2001:db8::5",
                 "::ffff:10.9.1.1", "::ffff:203.0.113.6"]
GARBAGE = ["", " ", "unknown", "_hidden", "[", "]", '"', "\\", ";", "=", "for=", "1.2.3", "::g", "[::1",
           "300.1.1.1", "1.2.3.4:x", "\x00", "é"]


@st.composite
def hop(draw) -> str:
    """One hop as a proxy or a client might write it: an address in any form, or garbage."""
    addr = draw(st.sampled_from(HOP_ADDRESSES))
    form = draw(st.sampled_from(["bare", "port", "brackets", "garbage", "text"]))
    if form == "port":
        return f"[{addr}]:443" if ":" in addr else f"{addr}:443"
    if form == "brackets":
        return f"[{addr}]"
    if form == "garbage":
        return draw(st.sampled_from(GARBAGE))
    if form == "text":
        return draw(st.text(max_size=12))
    return addr


@st.composite
def header_lines(draw, name: str) -> str | None:
    """A header's value as the edge passes it: absent, or 1-3 lines joined with `,`."""
    if draw(st.booleans()):
        return None
    lines = []
    for _ in range(draw(st.integers(1, 3))):
        hops = draw(st.lists(hop(), max_size=4))
        if name == "forwarded":
            sep = draw(st.sampled_from([";", ";proto=https;", ";by=10.9.0.1;"]))
            lines.append(", ".join(f'{sep.lstrip(";")}for="{h}"' if "[" in h else f"for={h}" for h in hops))
        else:
            lines.append(", ".join(hops))
    return ",".join(lines)


@given(
    peer=st.sampled_from(["127.0.0.1", "10.9.0.1", "fd00::7", "192.168.0.2", "203.0.113.7", "[fd00::7]:1",
                          "127.0.0.1:9", "garbage"]),
    xff=header_lines("x-forwarded-for"),
    forwarded=header_lines("forwarded"),
    real_ip=header_lines("x-real-ip"),
)
def test_any_forwarded_headers_never_raise_and_never_yield_the_proxy(peer, xff, forwarded, real_ip):
    headers = {"x-forwarded-for": xff, "forwarded": forwarded, "x-real-ip": real_ip}
    caller = client_address(peer, headers.get, PROXIES)
    trusted_peer = peer in ("127.0.0.1", "10.9.0.1", "fd00::7", "[fd00::7]:1", "127.0.0.1:9")
    assert caller.via_proxy is trusted_peer
    if caller.addr is not None:
        ip = ipaddress.ip_address(caller.addr)
        assert not any(ip in net for net in PROXIES)  # never a trusted proxy, the peer included
        assert ip.version == 4 or ip.ipv4_mapped is None  # mapped addresses come out as IPv4
    if not trusted_peer and any(v is not None for v in headers.values()):
        assert caller == Caller(None, False)  # spoofed: unknown, whatever the headers say
    if caller.via_proxy:
        assert not is_loopback(caller.addr) or decide_access(
            "admin", "outside", caller.addr, None, False, NETS, via_proxy=True, router_host=True, origin_ok=True
        ) == KEY_REQUIRED  # a forwarded loopback address is never keyless admin (rule 6)


@given(hops=st.lists(st.sampled_from(HOP_ADDRESSES), min_size=1, max_size=6))
def test_x_forwarded_for_is_the_right_most_untrusted_hop(hops):
    """The reference: walk the list from the right, skip trusted proxies, take the first other."""
    caller = client_address("10.9.0.1", {"x-forwarded-for": ", ".join(hops)}.get, PROXIES)
    plain = [getattr(ip, "ipv4_mapped", None) or ip for ip in map(ipaddress.ip_address, hops)]
    untrusted = [ip for ip in plain if not any(ip in net for net in PROXIES)]
    expected = str(untrusted[-1]) if untrusted else None
    assert caller == Caller(expected, True)


@given(
    forwarded_for=st.text(max_size=60),
    header=st.sampled_from(["x-forwarded-for", "forwarded", "x-real-ip"]),
    peer=st.sampled_from(["127.0.0.1", "::1", "192.168.0.2", "10.1.2.3", "203.0.113.7"]),
)
def test_forwarding_headers_from_an_untrusted_peer_are_always_outside(forwarded_for, header, peer):
    caller = client_address(peer, {header: forwarded_for}.get, proxy_nets("172.31.0.1"))
    assert caller == Caller(None, False)
    assert not is_inside(caller.addr, NETS) and not is_loopback(caller.addr)
    assert decide_access("use", "outside", caller.addr, None, False, NETS, **DIRECT_OK) == KEY_REQUIRED
    assert decide_access("admin", "outside", caller.addr, None, False, NETS, **DIRECT_OK) == KEY_REQUIRED


def test_the_asgi_edge_joins_every_line_of_a_header_in_order():
    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "client": ("::1", "5"),
             "headers": [(b"x-forwarded-for", b"198.51.100.1"), (b"host", b"x"), (b"x-forwarded-for", b"203.0.113.5")]}
    edge = AsgiEdge(scope, None, None)
    assert edge.header_lines("x-forwarded-for") == "198.51.100.1,203.0.113.5"
    assert edge.header_lines("forwarded") is None
    assert edge.client == "::1"
    caller = client_address(edge.client, edge.header_lines, proxy_nets("::1"))
    assert caller == Caller("203.0.113.5", True)  # the proxy's own line, not the client's first


# --- settings (rules 12-13) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, mode",
    [
        (None, "outside"), ("", "outside"), ("  ", "outside"),
        ("never", "never"), ("outside", "outside"), ("always", "always"),
        (" Always ", "always"), ("NEVER", "never"),
        ("nevr", "always"), ("off", "always"), ("0", "always"), ("false", "always"),  # fail closed
    ],
)
def test_require_key_mode(value, mode):
    assert require_key_mode(value) == mode


def test_trusted_nets_widen_the_defaults():
    nets = inside_nets("100.64.0.0/10, 203.0.113.5")
    assert nets[: len(DEFAULT_TRUSTED_NETS)] == DEFAULT_TRUSTED_NETS
    assert is_inside("100.64.1.1", nets) and is_inside("203.0.113.5", nets)
    assert is_inside("192.168.7.7", nets)  # still inside: widened, not replaced
    assert not is_inside("203.0.113.6", nets)
    assert not is_inside("100.64.1.1", inside_nets(None))


@pytest.mark.parametrize("value", ["10.0.0.0/33", "localhost", "1.2.3"])
def test_bad_nets_are_config_errors_naming_the_setting(value):
    with pytest.raises(ConfigError, match="HUGPY_ROUTER_TRUSTED_NETS"):
        inside_nets(value)
    with pytest.raises(ConfigError, match="HUGPY_ROUTER_TRUSTED_PROXIES"):
        proxy_nets(value)


@pytest.mark.parametrize(
    "addr, inside, loopback",
    [
        ("127.0.0.1", True, True), ("127.3.2.1", True, True), ("::1", True, True),
        ("::ffff:127.0.0.1", True, True), ("10.0.0.5", True, False), ("172.16.9.9", True, False),
        ("172.32.0.1", False, False), ("192.168.1.1", True, False), ("fd12::1", True, False),
        ("fe80::1", True, False), ("203.0.113.5", False, False), ("2001:db8::1", False, False),
        (None, False, False), ("junk", False, False),
    ],
)
def test_inside_and_loopback(addr, inside, loopback):
    assert is_inside(addr, NETS) is inside
    assert is_loopback(addr) is loopback


def test_loopback_includes_the_connections_own_address_but_not_unspecified():
    assert is_loopback("192.168.1.20", local_addr="192.168.1.20")
    assert not is_loopback("192.168.1.21", local_addr="192.168.1.20")
    assert not is_loopback("0.0.0.0", local_addr="0.0.0.0")


# --- the verdict (rules 7-11) -----------------------------------------------------------------

LOOP, LAN, OUT, UNKNOWN = "127.0.0.1", "192.168.1.9", "203.0.113.5", None


@pytest.mark.parametrize(
    "mode, addr, key_scope, presented, verdict",
    [
        # never: open to all without a key; a presented bad key is refused (rule 8b).
        ("never", OUT, None, False, ALLOW),
        ("never", UNKNOWN, None, True, KEY_INVALID),
        ("never", LOOP, None, True, KEY_INVALID),
        ("never", OUT, "use", True, ALLOW),
        # outside: inside callers pass without a key, but a presented one is judged (rule 8b).
        ("outside", LOOP, None, False, ALLOW),
        ("outside", LOOP, None, True, KEY_INVALID),
        ("outside", LAN, None, True, KEY_INVALID),
        ("outside", LAN, "use", True, ALLOW),
        ("outside", OUT, None, False, KEY_REQUIRED),
        ("outside", OUT, None, True, KEY_INVALID),
        ("outside", OUT, "use", True, ALLOW),
        ("outside", OUT, "admin", True, ALLOW),
        ("outside", UNKNOWN, None, False, KEY_REQUIRED),  # spoofed XFF counts as outside
        ("outside", UNKNOWN, "use", True, ALLOW),
        # always: a valid key even from loopback.
        ("always", LOOP, None, False, KEY_REQUIRED),
        ("always", LOOP, None, True, KEY_INVALID),
        ("always", LOOP, "use", True, ALLOW),
        ("always", OUT, "admin", True, ALLOW),
        # a typo fails closed: require_key_mode turns it into always.
        (require_key_mode("outsdie"), LAN, None, False, KEY_REQUIRED),
    ],
)
def test_use_routes(mode, addr, key_scope, presented, verdict):
    assert decide_access("use", mode, addr, key_scope, presented, NETS, **DIRECT_OK) == verdict


@pytest.mark.parametrize("mode", ["never", "outside", "always"])
@pytest.mark.parametrize(
    "addr, key_scope, presented, verdict",
    [
        (LOOP, None, False, ALLOW),  # loopback manages without a key, even under always
        ("::1", None, True, KEY_INVALID),  # ... but a presented bad key is refused (rule 9b)
        (LOOP, "use", True, ALLOW),  # a valid use key is no bad key: loopback still manages
        (LAN, None, False, KEY_REQUIRED),  # trusted nets never apply to admin routes
        (LAN, None, True, KEY_INVALID),
        (LAN, "use", True, SCOPE_TOO_NARROW),
        (OUT, "use", True, SCOPE_TOO_NARROW),
        (OUT, "admin", True, ALLOW),
        (UNKNOWN, None, False, KEY_REQUIRED),
        (UNKNOWN, "admin", True, ALLOW),
    ],
)
def test_admin_routes(mode, addr, key_scope, presented, verdict):
    assert decide_access("admin", mode, addr, key_scope, presented, NETS, **DIRECT_OK) == verdict


def test_admin_from_the_routers_own_lan_address_needs_no_key():
    assert decide_access("admin", "always", LAN, None, False, NETS, local_addr=LAN, **DIRECT_OK) == ALLOW
    assert decide_access("admin", "always", LAN, None, False, NETS, local_addr="0.0.0.0", **DIRECT_OK) == KEY_REQUIRED


@pytest.mark.parametrize("mode", ["never", "outside", "always"])
@pytest.mark.parametrize("addr", [LOOP, LAN, OUT, UNKNOWN])
def test_public_routes_are_open_in_every_mode(mode, addr):
    for via_proxy, router_host, origin_ok in [(False, False, False), (True, True, True)]:
        assert decide_access("public", mode, addr, None, True, NETS, via_proxy=via_proxy,
                             router_host=router_host, origin_ok=origin_ok) == ALLOW


@pytest.mark.parametrize(
    "addr, via_proxy, router_host, origin_ok, key_scope, presented, verdict",
    [
        # A foreign Origin is refused first, whatever the caller or key (rule 9a).
        (LOOP, False, True, False, None, False, ORIGIN_REFUSED),
        (OUT, False, True, False, "admin", True, ORIGIN_REFUSED),
        # Keyless loopback needs a Host that names the router (rule 9c: DNS rebinding) ...
        (LOOP, False, False, True, None, False, HOST_REFUSED),
        ("::1", False, False, True, None, False, HOST_REFUSED),
        (LOOP, False, False, True, "use", True, SCOPE_TOO_NARROW),
        (LOOP, False, False, True, None, True, KEY_INVALID),
        # ... which an admin key does not (rule 9b).
        (LOOP, False, False, True, "admin", True, ALLOW),
        (OUT, False, False, True, "admin", True, ALLOW),
        # A loopback address named by a proxy is not loopback (rule 6).
        (LOOP, True, True, True, None, False, KEY_REQUIRED),
        (LOOP, True, True, True, "use", True, SCOPE_TOO_NARROW),
        (LOOP, True, True, True, "admin", True, ALLOW),
        (LAN, True, True, True, None, False, KEY_REQUIRED),
    ],
)
def test_admin_routes_against_browsers_and_proxies(addr, via_proxy, router_host, origin_ok, key_scope, presented,
                                                   verdict):
    assert decide_access("admin", "outside", addr, key_scope, presented, NETS, via_proxy=via_proxy,
                         router_host=router_host, origin_ok=origin_ok) == verdict


def test_a_proxied_caller_is_judged_by_its_address_on_use_routes():
    assert decide_access("use", "outside", LAN, None, False, NETS, via_proxy=True, router_host=False,
                         origin_ok=True) == ALLOW
    assert decide_access("use", "outside", OUT, None, False, NETS, via_proxy=True, router_host=True,
                         origin_ok=True) == KEY_REQUIRED


@pytest.mark.parametrize("mode", ["never", "outside", "always"])
@pytest.mark.parametrize("addr", [LOOP, LAN, OUT, UNKNOWN])
@pytest.mark.parametrize("key_scope, presented", [(None, False), (None, True), ("use", True), ("admin", True)])
def test_a_cross_site_origin_is_refused_on_use_routes_whatever_the_key(mode, addr, key_scope, presented):
    """Issue 20 item 1 (rule 8a): as on admin routes."""
    assert decide_access("use", mode, addr, key_scope, presented, NETS, via_proxy=False, router_host=True,
                         origin_ok=False) == USE_ORIGIN_REFUSED


@pytest.mark.parametrize(
    "mode, addr, key_scope, presented, verdict",
    [
        # A keyless call that would be served needs a Host a rebound page cannot send (rule 8c) ...
        ("outside", LOOP, None, False, USE_HOST_REFUSED),
        ("outside", LAN, None, False, USE_HOST_REFUSED),
        ("never", OUT, None, False, USE_HOST_REFUSED),
        ("outside", LOOP, None, True, KEY_INVALID),  # a presented bad key is refused first (rule 8b)
        # ... which a valid key does not.
        ("outside", LOOP, "use", True, ALLOW),
        ("never", OUT, "admin", True, ALLOW),
        ("always", LOOP, "use", True, ALLOW),
        # A caller that needs a key anyway is told so first.
        ("outside", OUT, None, False, KEY_REQUIRED),
        ("always", LOOP, None, True, KEY_INVALID),
    ],
)
def test_a_keyless_use_call_under_a_foreign_host_is_refused(mode, addr, key_scope, presented, verdict):
    """Issue 20 item 2: DNS rebinding on use routes."""
    assert decide_access("use", mode, addr, key_scope, presented, NETS, via_proxy=False, router_host=False,
                         origin_ok=True, host_served=False) == verdict


@pytest.mark.parametrize(
    "scope, mode, addr, verdict",
    [
        # Where no key is needed, a placeholder passes as if none were sent ...
        ("use", "outside", LOOP, ALLOW), ("use", "outside", LAN, ALLOW), ("use", "never", OUT, ALLOW),
        ("admin", "always", LOOP, ALLOW),
        # ... and where one is, it is an invalid key.
        ("use", "outside", OUT, KEY_INVALID), ("use", "always", LOOP, KEY_INVALID),
        ("admin", "outside", LAN, KEY_INVALID),
    ],
)
def test_a_placeholder_is_refused_only_where_a_key_is_needed(scope, mode, addr, verdict):
    """Rule 1a: the openai client's required `api_key` (`x`, `unused`) is no key from inside."""
    assert decide_access(scope, mode, addr, None, True, NETS, placeholder=True, **DIRECT_OK) == verdict


def gate_call(gate: AccessGate, scope: str, headers: dict[str, str], address: str = LOOP) -> tuple[Verdict, str | None]:
    """The gate's verdict on one call from `address` (Host `localhost`), and the key it counts against."""
    raw = [(b"host", b"localhost:8080")] + [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    edge = AsgiEdge({"type": "http", "method": "POST", "path": "/x", "query_string": b"", "client": (address, 5),
                     "headers": raw}, None, None)
    return gate.check(edge, scope), edge.key_id


@pytest.mark.parametrize("mode", ["never", "outside", "always"])
def test_a_presented_key_is_judged_from_loopback_in_every_mode(tmp_path, mode):
    """Issue 38 item 2: an unknown, revoked, expired or malformed key, or an empty Bearer, is 401 on
    use and admin routes from loopback and the trusted nets too. Another scheme or another header
    is no key, and keeps the mode's rule; a placeholder passes where no key is needed."""
    keys = KeyStore(tmp_path / "router.sqlite3")
    revoked_id, revoked = keys.create("gone", "use")
    keys.revoke(revoked_id)
    expired = keys.create("old", "use", expires_days=1e-9)[1]  # 86 µs
    valid_id, valid = keys.create("ok", "use")
    time.sleep(0.01)
    gate = AccessGate(keys, environ={"HUGPY_ROUTER_REQUIRE_KEY": mode})
    for bearer in ("hpk_nobody_secret", revoked, expired, "hpk_malformed", "", valid[:-1] + "?"):
        for scope in ("use", "admin"):
            for address in (LOOP, LAN):
                verdict, key_id = gate_call(gate, scope, {"Authorization": f"Bearer {bearer}"}, address)
                assert (verdict, key_id) == (KEY_INVALID, None), (bearer, scope, address)
    assert gate_call(gate, "use", {"Authorization": f"Bearer {valid}"}, LAN) == (ALLOW, valid_id)
    assert gate_call(gate, "admin", {"Authorization": f"Bearer {valid}"}) == (ALLOW, valid_id)  # loopback manages
    keyless = KEY_REQUIRED if mode == "always" else ALLOW
    for no_key in ({}, {"Authorization": "Basic dTpw"}, {"x-api-key": "hpk_nobody_secret"}):
        assert gate_call(gate, "use", no_key) == (keyless, None), no_key
        assert gate_call(gate, "admin", no_key) == (ALLOW, None), no_key
    placeholder = {"Authorization": "Bearer lm-studio"}
    assert gate_call(gate, "use", placeholder) == (KEY_INVALID if mode == "always" else ALLOW, None)
    assert gate_call(gate, "admin", placeholder) == (ALLOW, None)


@pytest.mark.parametrize(
    "host, served",
    [
        (None, True), ("127.0.0.1:8080", True), ("192.168.1.5:8080", True), ("203.0.113.5", True),
        ("[fd00::5]:1", True), ("[::1]:8080", True), ("0.0.0.0:11434", True),
        ("localhost", True), ("LOCALHOST:8080", True), ("app.localhost", True), ("gpu-box.local:11434", True),
        ("gpu-box.internal", True), ("gpu-box", True), ("GPU-Box.:8080", True), ("router.lan", True),
        ("evil.example", False), ("evil.example:11434", False), ("localhost.evil.example", False),
        ("gpu-box.evil.example", False), ("", False), ("[", False), ("1.2.3.4.evil", False),
        ("printer:8080", True), ("x", True),  # a single label: hosts file or search domain, never public DNS
    ],
)
def test_serves_host(host, served):
    assert serves_host(host, frozenset({"gpu-box", "router.lan"})) is served


@pytest.mark.parametrize(
    "host, allowed, names",
    [
        ("localhost", "", True), ("LOCALHOST:8080", "", True), ("localhost.", "", True),
        ("127.0.0.1:8080", "", True), ("127.9.9.9", "", True), ("[::1]:8080", "", True), ("::1", "", True),
        ("[::ffff:127.0.0.1]", "", True),
        ("evil.example:8080", "", False), ("localhost.evil.example", "", False), ("0.0.0.0:8080", "", False),
        ("192.168.1.5:8080", "", False), ("", "", False), (None, "", False), ("[", "", False),
        ("router.lan:8080", "router.lan", True), ("Router.LAN", "router.lan:9", True),
        ("192.168.1.5:8080", "192.168.1.5, router.lan", True), ("[fd00::5]:1", "[fd00::5]", True),
    ],
)
def test_names_router(host, allowed, names):
    assert names_router(host, allowed_hosts(allowed)) is names


@pytest.mark.parametrize(
    "origin, host, allowed, ok",
    [
        (None, "localhost:8080", "", True),  # not a browser, or a same-origin GET
        ("http://localhost:8080", "localhost:8080", "", True),  # the router's own pages
        ("https://router.lan", "router.lan:443", "", True),  # default ports
        ("http://127.0.0.1:8080", "localhost:8080", "", False),
        ("https://evil.example", "localhost:8080", "", False),
        ("http://localhost:8081", "localhost:8080", "", False),
        ("null", "localhost:8080", "", False),
        ("file://", "localhost:8080", "", False),
        ("http://localhost:8080", None, "", False),
        ("https://dash.example", "localhost:8080", "https://dash.example", True),
        ("HTTPS://Dash.Example:443", "localhost:8080", "https://dash.example/", True),
        ("https://dash.example:8443", "localhost:8080", "https://dash.example", False),
        ("http://[::1]:8080", "[::1]:8080", "", True),
    ],
)
def test_origin_allowed(origin, host, allowed, ok):
    assert origin_allowed(origin, host, allowed_origins(allowed)) is ok


@pytest.mark.parametrize("value", ["dash.example", "ftp://x", "https://", "https://a/b"])
def test_bad_allowed_origins_are_config_errors(value):
    with pytest.raises(ConfigError, match="HUGPY_ROUTER_ALLOWED_ORIGINS"):
        allowed_origins(value)


@pytest.mark.parametrize(
    "content_type, ok",
    [("application/json", True), ("Application/JSON; charset=utf-8", True), (" application/json ", True),
     ("text/plain", False), ("application/x-www-form-urlencoded", False), ("multipart/form-data; b=x", False),
     ("application/jsonp", False), (None, False), ("", False)],
)
def test_is_json(content_type, ok):
    assert is_json(content_type) is ok
    assert NOT_JSON[:3] == (False, 415, "unsupported_media_type")


def test_verdict_shapes_match_hugpy():
    assert KEY_REQUIRED[:3] == (False, 401, "invalid_api_key")
    assert KEY_REQUIRED.message.startswith("an API key is required from here")
    assert KEY_INVALID[:3] == (False, 401, "invalid_api_key")
    assert KEY_INVALID.message == "invalid, expired or revoked API key"
    assert SCOPE_TOO_NARROW[:3] == (False, 403, "insufficient_scope")
    assert "(scope use); an admin key is needed" in SCOPE_TOO_NARROW.message


def test_core_access_imports_only_stdlib_and_core():
    tree = ast.parse(Path(access.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    outside = {
        m for m in modules
        if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__" and not m.startswith("router.core.")
    }
    assert outside == set()
