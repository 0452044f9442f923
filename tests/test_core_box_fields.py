"""router.core.box_fields: the rules for a box's fields, against any input (Hypothesis), and the
table of what names this router's own listener."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.box_fields import check_key, check_pool, check_url, names_listener
from router.core.errors import ConfigError

URLISH = st.one_of(
    st.text(max_size=60),
    st.builds(lambda scheme, host, port, tail: f"{scheme}://{host}:{port}{tail}",
              st.sampled_from(["http", "https", "ftp", "HTTP", ""]),
              st.text(alphabet="ab-_.[]:@ \t\n1%", max_size=12),
              st.one_of(st.integers(-5, 70000).map(str), st.text(max_size=4)),
              st.sampled_from(["", "/", "/v1", "?q", "#f"])),
)


@given(URLISH)
def test_a_url_is_refused_with_a_config_error_or_is_one_the_pool_can_reach(url):
    try:
        scheme, host, port = check_url("url", url)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    parts = urlsplit(url)
    assert scheme in ("http", "https") and 1 <= port <= 65535
    assert host == parts.hostname and parts.username is None and not parts.fragment and not parts.query
    assert all(0x21 <= ord(c) <= 0x7E for c in url)


@given(st.text(max_size=40))
def test_a_key_is_visible_ascii_or_refused_without_being_shown(key):
    try:
        assert check_key(key) == key and all(0x21 <= ord(c) <= 0x7E for c in key)
    except ConfigError as exc:
        assert key not in str(exc) or len(key) < 3


@pytest.mark.parametrize("pool, ok", [("lab", True), ("", True), ("gpu a", True), ("lab\u202e", False),
                                      ("a\x00", False), ("x" * 257, False)])
def test_pools(pool, ok):
    if ok:
        check_pool(pool)
    else:
        with pytest.raises(ConfigError):
            check_pool(pool)


OWN = frozenset({"gpu-host", "10.0.0.5"})


@pytest.mark.parametrize("host, port, bind, expected", [
    ("127.0.0.1", 8080, "127.0.0.1", True),
    ("localhost", 8080, "127.0.0.1", True),
    ("::1", 8080, "127.0.0.1", True),
    ("127.0.0.1", 8081, "127.0.0.1", False),  # another port: another server
    ("10.0.0.5", 8080, "127.0.0.1", False),  # a loopback bind is not reached from 10.0.0.5
    ("10.0.0.5", 8080, "0.0.0.0", True),
    ("GPU-HOST", 8080, "0.0.0.0", True),
    ("localhost", 8080, "::", True),
    ("10.0.0.9", 8080, "0.0.0.0", False),  # another machine
    ("10.0.0.5", 8080, "10.0.0.5", True),
    ("127.0.0.1", 8080, "10.0.0.5", False),
])
def test_what_names_this_routers_listener(host, port, bind, expected):
    assert names_listener(host, port, bind, frozenset({8080, 11434}), OWN) is expected


@pytest.mark.parametrize("url", ["http://127.1:8080", "http://2130706433:8080", "http://0x7f.0.0.1:8080",
                                 "http://10.0.0.0377:8080", "http://gpu.7:8080"])
def test_an_ipv4_shorthand_is_no_host(url):
    """The resolver reads each as an address (`127.1` is 127.0.0.1): taken as a DNS name, it
    would hide a loopback address from the listener check."""
    with pytest.raises(ConfigError, match="no valid host"):
        check_url("url", url)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "::ffff:127.0.0.1"])
def test_a_wildcard_or_mapped_loopback_address_names_a_loopback_listener(host):
    assert names_listener(host, 8080, "127.0.0.1", frozenset({8080}), OWN) is True
