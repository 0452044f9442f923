"""Keys and access (router/core/access.py): one test per rule of its docstring, as tables, plus
property tests where a rule holds for every input (key round-trip, spoofed forwarding)."""

from __future__ import annotations

import ast
import hashlib
import string
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core import access
from router.core.access import (
    ALLOW,
    DEFAULT_TRUSTED_NETS,
    KEY_INVALID,
    KEY_REQUIRED,
    SCOPE_TOO_NARROW,
    bearer_token,
    client_address,
    decide_access,
    hash_secret,
    inside_nets,
    is_inside,
    is_loopback,
    parse_key,
    proxy_nets,
    require_key_mode,
)
from router.core.errors import ConfigError

URLSAFE = string.ascii_letters + string.digits + "-_"
NETS = inside_nets(None)


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
        ("Basic abc", None),
        ("Bearer ", None),
        (None, None),
    ],
)
def test_bearer_token(header, expected):
    assert bearer_token(header) == expected


# --- the caller's address (rules 3-5) ---------------------------------------------------------

PROXY = proxy_nets("127.0.0.1, 10.9.0.0/16")


@pytest.mark.parametrize(
    "peer, headers, proxies, expected",
    [
        # No forwarding headers: the peer is the caller.
        ("203.0.113.9", {}, (), "203.0.113.9"),
        ("::ffff:192.168.1.4", {}, (), "192.168.1.4"),  # rule 5
        ("::1", {}, (), "::1"),
        ("not-an-ip", {}, (), None),
        # Spoofed: any forwarding header from an untrusted peer makes the caller unknown.
        ("192.168.1.4", {"x_forwarded_for": "127.0.0.1"}, (), None),
        ("127.0.0.1", {"x_forwarded_for": "127.0.0.1"}, (), None),
        ("192.168.1.4", {"x_real_ip": "127.0.0.1"}, PROXY, None),
        ("192.168.1.4", {"forwarded": "for=127.0.0.1"}, PROXY, None),
        # Trusted proxy: XFF right to left, skipping trusted proxies (hugpy's [run] cases).
        ("127.0.0.1", {"x_forwarded_for": "127.0.0.1"}, PROXY, "127.0.0.1"),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5"}, PROXY, "203.0.113.5"),
        ("127.0.0.1", {"x_forwarded_for": "203.0.113.5, 127.0.0.1"}, PROXY, "203.0.113.5"),
        ("127.0.0.1", {"x_forwarded_for": "198.51.100.1, 203.0.113.5, 10.9.3.3"}, PROXY, "203.0.113.5"),
        ("127.0.0.1", {"x_forwarded_for": "::ffff:203.0.113.5"}, PROXY, "203.0.113.5"),
        ("127.0.0.1", {"x_forwarded_for": "garbage, 10.9.3.3"}, PROXY, None),  # unparsable hop
        ("127.0.0.1", {"x_forwarded_for": "10.9.1.1, 127.0.0.1"}, PROXY, "127.0.0.1"),  # all trusted
        ("127.0.0.1", {"x_real_ip": "203.0.113.5"}, PROXY, "127.0.0.1"),  # only XFF is walked
        ("::ffff:127.0.0.1", {"x_forwarded_for": "203.0.113.5"}, PROXY, "203.0.113.5"),
    ],
)
def test_client_address_table(peer, headers, proxies, expected):
    assert client_address(peer, hdrs(**headers), proxies) == expected


@given(
    forwarded_for=st.text(max_size=60),
    header=st.sampled_from(["x-forwarded-for", "forwarded", "x-real-ip"]),
    peer=st.sampled_from(["127.0.0.1", "::1", "192.168.0.2", "10.1.2.3", "203.0.113.7"]),
)
def test_forwarding_headers_from_an_untrusted_peer_are_always_outside(forwarded_for, header, peer):
    addr = client_address(peer, {header: forwarded_for}.get, proxy_nets("172.31.0.1"))
    assert addr is None
    assert not is_inside(addr, NETS) and not is_loopback(addr)
    assert decide_access("use", "outside", addr, None, False, NETS) == KEY_REQUIRED
    assert decide_access("admin", "outside", addr, None, False, NETS) == KEY_REQUIRED


# --- settings (rules 9-10) --------------------------------------------------------------------


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


# --- the verdict (rules 6-8) ------------------------------------------------------------------

LOOP, LAN, OUT, UNKNOWN = "127.0.0.1", "192.168.1.9", "203.0.113.5", None


@pytest.mark.parametrize(
    "mode, addr, key_scope, presented, verdict",
    [
        # never: open to all, key ignored.
        ("never", OUT, None, False, ALLOW),
        ("never", UNKNOWN, None, True, ALLOW),
        # outside: inside callers pass without the key being looked at (a bad key passes).
        ("outside", LOOP, None, False, ALLOW),
        ("outside", LAN, None, True, ALLOW),
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
    assert decide_access("use", mode, addr, key_scope, presented, NETS) == verdict


@pytest.mark.parametrize("mode", ["never", "outside", "always"])
@pytest.mark.parametrize(
    "addr, key_scope, presented, verdict",
    [
        (LOOP, None, False, ALLOW),  # loopback manages without a key, even under always
        ("::1", None, True, ALLOW),
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
    assert decide_access("admin", mode, addr, key_scope, presented, NETS) == verdict


def test_admin_from_the_routers_own_lan_address_needs_no_key():
    assert decide_access("admin", "always", LAN, None, False, NETS, local_addr=LAN) == ALLOW
    assert decide_access("admin", "always", LAN, None, False, NETS, local_addr="0.0.0.0") == KEY_REQUIRED


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
