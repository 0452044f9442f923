"""The balancer recipe of docs/several-routers.md through a real HAProxy (issue 36 item 5): the
routers tell its callers apart, and a router with an unlisted balancer in front says so.

The HAProxy block and the routers' settings are read from the recipe itself; only its addresses
are made loopback ones. Callers come from 127.0.0.2, .3 and .4 (every 127.x address is this
host); an Internet caller is named to HAProxy by the PROXY protocol on a second `bind` of the
test's own, as an L4 balancer in front of it would.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from router.core import access
from router.serve.access import AccessGate
from router.serve.edge import AsgiEdge
from router.sim import SimBox
from router.store.keys import KeyStore

from conftest import ROOT, wait_for
from support.url_calls import ADMIN_KEY, CHAT, call, route_rows

pytestmark = pytest.mark.timeout(120)
RECIPE = ROOT / "docs" / "several-routers.md"
INTERNET = "203.0.113.7"


def recipe_blocks() -> tuple[str, dict[str, str]]:
    """The recipe's HAProxy configuration, and the settings it gives the routers."""
    blocks = re.findall(r"```\n(.*?)```", RECIPE.read_text(), re.S)
    haproxy = next(b for b in blocks if b.startswith("frontend "))
    settings = next(b for b in blocks if "HUGPY_ROUTER_TRUSTED_PROXIES=" in b)
    env = dict(re.findall(r"^export (\w+)=(\S+)", settings, re.M))
    return haproxy, env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HAProxy:
    """The recipe's HAProxy on loopback ports in front of `router_port`: `port` as the recipe
    binds it, `proxied_port` the same frontend taking the PROXY protocol."""

    def __init__(self, config: str, router_port: int, workdir: Path) -> None:
        binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
        if binary is None:
            raise RuntimeError("haproxy is not installed (scripts/setup installs it)")
        self.port, self.proxied_port = free_port(), free_port()
        binds = rf"\1bind 127.0.0.1:{self.port}\n\1bind 127.0.0.1:{self.proxied_port} accept-proxy"
        config = re.sub(r"^(\s*)bind \S+", binds, config, flags=re.M)
        config = re.sub(r"^(\s*server \S+) \S+", rf"\1 127.0.0.1:{router_port}", config, flags=re.M)
        path = workdir / "haproxy.cfg"
        path.write_text("global\n    maxconn 256\n" + config)
        self.log = workdir / "haproxy.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([binary, "-db", "-f", str(path)], stdout=out, stderr=subprocess.STDOUT)
        up = wait_for(lambda: self.proc.poll() is None and self._accepts(), 10, 0.05)
        if not up:
            self.stop()
            raise RuntimeError(f"haproxy did not start:\n{self.log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accepts(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            return True
        except OSError:
            return False

    def call_from(self, address: str, method: str, path: str, body: bytes = b"", key: str | None = None) -> int:
        """The status of one request whose caller the PROXY protocol names as `address`."""
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        with socket.create_connection(("127.0.0.1", self.proxied_port), 10) as sock:
            sock.sendall(f"PROXY TCP4 {address} 127.0.0.1 40000 {self.proxied_port}\r\n".encode()
                         + f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            head = b""
            while b"\r\n" not in head and (data := sock.recv(4096)):
                head += data
        return int(head.split(b" ", 2)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def balancer(tmp_path):
    """balancer(router) -> HAProxy: the recipe's, in front of `router`; stopped at the end."""
    started: list[HAProxy] = []

    def start(router) -> HAProxy:
        haproxy = HAProxy(recipe_blocks()[0], int(router.url.rsplit(":", 1)[1]), tmp_path)
        started.append(haproxy)
        return haproxy

    yield start
    for haproxy in started:
        haproxy.stop()


def recipe_env() -> dict[str, str]:
    """The recipe's router settings, the balancer's address being loopback here."""
    env = recipe_blocks()[1]
    assert env.get("HUGPY_ROUTER_REQUIRE_KEY") == "always"  # behind any balancer (the recipe says why)
    return {**env, "HUGPY_ROUTER_TRUSTED_PROXIES": "127.0.0.1", "HUGPY_ROUTER_KEY": ADMIN_KEY}


def test_the_recipe_tells_callers_apart_and_never_makes_them_the_operator(start_fleet_in_process, balancer):
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]), env=recipe_env())
    haproxy = balancer(router)
    status, _, data = call(router.url, "POST", "/v1/keys", {"name": "team"}, key=ADMIN_KEY)
    assert status == 201, data
    key = json.loads(data)["key"]
    for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, source=source, key=key)[0] == 200
    # A caller that writes its own X-Forwarded-For is still the address HAProxy saw (right-most).
    spoofed = {"X-Forwarded-For": "10.9.9.9"}
    assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, spoofed, source="127.0.0.2", key=key)[0] == 200
    # Through the balancer on this host, nobody is the operator: a keyless admin call is refused,
    # and so is a keyless call (`always`), from loopback callers and the Internet alike.
    status, _, data = call(haproxy.url, "POST", "/v1/keys", {"name": "stolen"}, source="127.0.0.2")
    assert status == 401, data
    assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, source="127.0.0.3")[0] == 401
    assert haproxy.call_from(INTERNET, "POST", "/v1/keys", b'{"name": "stolen"}') == 401
    assert haproxy.call_from(INTERNET, "POST", "/v1/chat/completions", json.dumps(CHAT).encode()) == 401
    assert haproxy.call_from(INTERNET, "POST", "/v1/chat/completions", json.dumps(CHAT).encode(), key) == 200
    served = wait_for(lambda: (r := [x for x in route_rows(router) if x["route"] == "/v1/chat/completions"])
                      and len(r) == 5 and r, 5)
    assert sorted(r["client"] for r in served) == ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.4", INTERNET]


def test_through_the_recipe_a_keyless_caller_counts_as_its_own_address(start_fleet_in_process, balancer):
    """Under `outside` (not the recipe's mode: this is what its addresses decide): the Internet
    caller is outside, and `--default-rpm` counts each caller apart."""
    env = {**recipe_env(), "HUGPY_ROUTER_REQUIRE_KEY": "outside"}
    router = start_fleet_in_process(SimBox("a", catalog=["tiny"], residents=["tiny"]),
                                    extra_args=("--default-rpm", "1"), env=env)
    haproxy = balancer(router)
    assert haproxy.call_from(INTERNET, "POST", "/v1/chat/completions", json.dumps(CHAT).encode()) == 401
    assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, source="127.0.0.2")[0] == 200
    assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, source="127.0.0.2")[0] == 429
    assert call(haproxy.url, "POST", "/v1/chat/completions", CHAT, source="127.0.0.3")[0] == 200
    assert call(haproxy.url, "POST", "/v1/keys", {"name": "stolen"}, source="127.0.0.3")[0] == 401


def edge_from(address: str) -> AsgiEdge:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "client": (address, 40000), "headers": [(b"host", b"10.0.0.1:8090")]}
    return AsgiEdge(scope, None, None)


@pytest.mark.parametrize("addresses, warned", [
    (["10.0.0.7"], True),  # a balancer in TCP mode on the LAN, unlisted
    (["fd00::7"], True),
    (["127.0.0.1"], False),  # a workstation
    (["203.0.113.5"], False),  # outside: a key is wanted anyway
    (["10.0.0.7", "10.0.0.8"], False),  # two callers: no balancer hides them
])
def test_one_private_address_and_no_trusted_proxy_is_said_once(tmp_path, caplog, addresses, warned):
    gate = AccessGate(KeyStore(tmp_path / "router.sqlite3"), environ={})
    with caplog.at_level(logging.WARNING, logger="router.serve"):
        for i in range(3 * access.SOLE_CALLER_CALLS):
            gate.check(edge_from(addresses[i % len(addresses)]), "use")
    said = [r for r in caplog.records if "HUGPY_ROUTER_TRUSTED_PROXIES is empty" in r.getMessage()]
    assert len(said) == (1 if warned else 0)
    if warned:
        assert addresses[0] in said[0].getMessage() and "several-routers.md" in said[0].getMessage()


def test_a_listed_proxy_is_not_watched(tmp_path, caplog):
    gate = AccessGate(KeyStore(tmp_path / "router.sqlite3"), environ={"HUGPY_ROUTER_TRUSTED_PROXIES": "10.0.0.7"})
    with caplog.at_level(logging.WARNING, logger="router.serve"):
        for _ in range(2 * access.SOLE_CALLER_CALLS):
            gate.check(edge_from("10.0.0.7"), "use")
    assert not caplog.records
