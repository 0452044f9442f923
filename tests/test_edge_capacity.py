"""Connection capacity (issue 11 item 1): one address holding thousands of idle connections does
not stop the router answering everyone else; idle connections are closed; the per-client cap
spares trusted proxies; what an idle connection costs.

Distinct client addresses are loopback's own 127.0.0.0/8: a socket bound to 127.0.0.2 before
connecting is another client as far as the router can tell. Counts and times are bounded: a
few thousand sockets, seconds.
"""

from __future__ import annotations

import errno
import resource
import socket
import time
import urllib.request
from urllib.parse import urlsplit

import openai
import psutil
import pytest

from router.core.conn_cap import excess
from router.sim import SimBox

from conftest import wait_for

ATTACKER = "127.0.0.2"


@pytest.fixture(autouse=True)
def enough_descriptors():
    """The test process holds a few thousand sockets: raise its own soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 8192:
        pytest.skip(f"needs 8192 descriptors, the hard limit is {hard}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def address(router) -> tuple[str, int]:
    url = urlsplit(router.url)
    return url.hostname, url.port


def open_idle(router, source: str, count: int) -> list[socket.socket]:
    """`count` connections from `source` that send nothing, opened without waiting for each."""
    target = address(router)
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        err = sock.connect_ex(target)
        assert err in (0, errno.EINPROGRESS), errno.errorcode.get(err)
        socks.append(sock)
    return socks


def held_from(router, source: str) -> int:
    """How many connections from `source` the router process holds open right now."""
    return sum(
        1
        for conn in psutil.Process(router.pid).net_connections(kind="tcp")
        if conn.raddr and conn.raddr.ip == source and conn.status == psutil.CONN_ESTABLISHED
    )


def closed_by_router(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset, or never connected
        return True


def health(router, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(router.url + "/health", timeout=timeout) as response:
        return response.status


def test_thousands_of_idle_connections_from_one_address_leave_health_and_calls_working(start_fleet):
    # 1,536 descriptors: the router takes (1536 - 1024) / 2 = 256 connections at once, so 3,000
    # idle ones from one address would take every accept permit if the cap did not close them.
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box, extra_args=("--max-conns-per-client", "50", "--idle-timeout", "60"),
                         nofile=1536)
    socks = open_idle(router, ATTACKER, 3000)
    try:
        # The cap keeps the attacker at 50 open connections (the accept queue drains as the
        # excess is closed)...
        assert wait_for(lambda: held_from(router, ATTACKER) <= 50, timeout=20, interval=0.25)
        # ...while the router answers everyone else.
        assert health(router) == 200
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content
        assert "over the per-client cap of 50" in router.log_text()
    finally:
        for sock in socks:
            sock.close()


def test_idle_and_slow_connections_are_closed_after_the_idle_timeout(start_fleet):
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box, extra_args=("--idle-timeout", "1"))
    idle = open_idle(router, "127.0.0.3", 200)
    # A slow client: half a request head, never finished.
    slow = socket.create_connection(address(router))
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    # A kept-alive client: one answer, then nothing.
    kept = socket.create_connection(address(router))
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    kept.settimeout(5)
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    try:
        for sock in (slow, kept):
            sock.settimeout(5)
            assert sock.recv(4096) == b""  # closed by the router
        assert time.monotonic() - started < 3
        assert wait_for(lambda: all(closed_by_router(s) for s in idle), timeout=3)
        assert held_from(router, "127.0.0.3") == 0
        assert health(router) == 200
    finally:
        for sock in (*idle, slow, kept):
            sock.close()


def test_trusted_proxies_are_not_capped(start_fleet):
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(
        box,
        extra_args=("--max-conns-per-client", "20", "--idle-timeout", "60"),
        env={"HUGPY_ROUTER_TRUSTED_PROXIES": "127.0.0.4/32"},
    )
    proxy = open_idle(router, "127.0.0.4", 60)
    other = open_idle(router, "127.0.0.5", 60)
    try:
        assert wait_for(lambda: held_from(router, "127.0.0.5") <= 20, timeout=5)
        time.sleep(0.6)  # two more sweeps
        assert held_from(router, "127.0.0.4") == 60
        assert not any(closed_by_router(s) for s in proxy)
    finally:
        for sock in (*proxy, *other):
            sock.close()


def test_memory_per_idle_connection(start_fleet):
    """Router RSS with 2,000 idle connections open, against none, then once each has had one
    answer (hyper keeps its read buffer): the figures the issue's note reports, bounded loosely
    so that a leak per connection fails."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box, extra_args=("--max-conns-per-client", "0", "--idle-timeout", "60"))
    process = psutil.Process(router.pid)
    assert health(router) == 200
    before = process.memory_info().rss
    socks = open_idle(router, "127.0.0.6", 2000)
    try:
        assert wait_for(lambda: held_from(router, "127.0.0.6") == 2000, timeout=10, interval=0.2)
        time.sleep(0.5)
        never_asked = (process.memory_info().rss - before) / 2000
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in socks:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
        answered = (process.memory_info().rss - before) / 2000
        print(f"router RSS per idle connection: {never_asked:.0f} B before a request, "
              f"{answered:.0f} B after one")
        assert never_asked < 32 * 1024 and answered < 64 * 1024
    finally:
        for sock in socks:
            sock.close()


# --- the cap's rule, pure (router.core.conn_cap) ----------------------------------------------


def test_excess_keeps_the_oldest_per_address_and_spares_trusted_proxies():
    import ipaddress

    def packed(text: str) -> bytes:
        return ipaddress.ip_address(text).packed

    conns = [(packed("10.0.0.1"), i) for i in (5, 1, 4, 2, 3)]
    conns += [(packed("::ffff:10.0.0.1"), 9)]  # the same client through a dual-stack listener
    conns += [(packed("10.0.0.2"), 7), (packed("2001:db8::1"), 8), (packed("2001:db8::1"), 6)]
    conns += [(packed("10.0.0.9"), i) for i in (11, 12, 13)]
    proxies = [ipaddress.ip_network("10.0.0.9/32")]
    assert sorted(excess(conns, 3, proxies)) == [4, 5, 9]
    assert excess(conns, 0, proxies) == []
    assert sorted(excess(conns, 1, [])) == [2, 3, 4, 5, 8, 9, 12, 13]


def test_answers_name_the_router_never_granian(start_fleet):
    """Issue 11 item 8: Granian adds `server: granian` to any answer without a Server header."""
    import http.client
    import json

    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box)
    host, port = address(router)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/no/such/route", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        ("POST", "/v1/chat/completions", {**chat, "model": "absent"}),
    ]:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"content-type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        assert answer.headers.get_all("server") == ["router"], (path, body)
        conn.close()


def test_the_idle_timeout_never_cuts_a_call_in_progress(start_fleet):
    """The timeout runs only while the router waits for a request head: a cold load longer than
    it, and a stream longer than it, come through whole."""
    box = SimBox("a", catalog=["tiny"], chunks=5, cadence_s=0.4, load_s=1.5)
    router = start_fleet(box, extra_args=("--idle-timeout", "1"))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    started = time.monotonic()
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert [c for c in stream if c.choices and c.choices[0].finish_reason == "stop"]
    assert time.monotonic() - started > 2.5  # both outlasted the timeout
