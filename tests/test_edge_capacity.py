"""Connection capacity (issue 11 item 1): one address holding thousands of idle connections does
not stop the router answering everyone else; idle connections are closed; the per-client cap
spares trusted proxies; what an idle connection costs.

Distinct client addresses are loopback's own 127.0.0.0/8: a socket bound to 127.0.0.2 before
connecting is another client as far as the router can tell. Counts and times are bounded: a
few thousand sockets, seconds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import http.client
import ipaddress
import json
import resource
import selectors
import socket
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import openai
import psutil
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.conn_cap import FRESH_MS, Conn, near_limit, over_cap, peer_key
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


def test_heads_trickled_a_byte_at_a_time_are_capped_like_idle_sockets(start_fleet):
    """A connection is closed only once idle FRESH_MS (router.core.conn_cap), so that a request
    read and not yet started is never cut; a client that sends its head a byte every 0.2 s is
    never idle that long, and is capped from a FRESH_MS after the first look that found it not
    working."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box, extra_args=("--max-conns-per-client", "8", "--idle-timeout", "60"))
    source = "127.0.0.8"
    socks = open_idle(router, source, 20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    try:
        assert wait_for(lambda: held_from(router, source) == 20, timeout=5)
        deadline = time.monotonic() + 8
        sent = 0
        while time.monotonic() < deadline and held_from(router, source) > 8:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.send(head[sent:sent + 1])
            sent += 1
            time.sleep(0.2)
        assert held_from(router, source) <= 8
        assert "over the per-client cap of 8" in router.log_text()
    finally:
        for sock in socks:
            sock.close()


def stream_from(router, source: str, timeout: float = 30) -> bytes:
    """A streamed chat call from `source`, read to its end: the whole SSE body (b"" when cut)."""
    host, port = address(router)
    conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"model": "tiny", "stream": True,
                                      "messages": [{"role": "user", "content": "hi"}]}))
        answer = conn.getresponse()
        return answer.read()
    except (OSError, http.client.HTTPException):
        return b""
    finally:
        conn.close()


@pytest.mark.parametrize("stream_first", [False, True], ids=["idle-then-stream", "silent-stream-then-idle"])
def test_the_cap_closes_idle_connections_never_a_working_stream(start_fleet, stream_first):
    """Issue 20 item 7: one address at the cap of 8, plus a stream. The cap closes one idle socket
    and never the stream: not when the stream is the newest connection (the issue's case: the
    newest were closed), nor when it is the longest silent one (a cold load sends nothing for
    1.5 s, while the idle sockets opened after it are younger): a call in flight is working
    however long it has been silent."""
    box = SimBox("a", catalog=["tiny"], chunks=4, cadence_s=0.25, load_s=1.5)
    router = start_fleet(box, extra_args=("--max-conns-per-client", "8", "--idle-timeout", "60"))
    source = "127.0.0.7"
    idle: list[socket.socket] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            if stream_first:
                stream = pool.submit(stream_from, router, source)
                time.sleep(1.0)  # the box is loading: nothing has gone either way since the request
                idle = open_idle(router, source, 8)
            else:
                idle = open_idle(router, source, 8)
                assert wait_for(lambda: held_from(router, source) == 8, timeout=5)
                time.sleep(0.6)  # at the cap: two sweeps close nothing
                assert not any(closed_by_router(s) for s in idle)
                stream = pool.submit(stream_from, router, source)
            # 9 connections, one working: the cap closes one idle socket...
            assert wait_for(lambda: any(closed_by_router(s) for s in idle), timeout=5)
            body = stream.result()
        # ...and only one, while the stream came through whole. (Which idle one is not pinned:
        # they were opened within a millisecond, the kernel's idle clock's step.)
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        assert sum(closed_by_router(s) for s in idle) == 1
    finally:
        for sock in idle:
            sock.close()


def test_near_the_limit_idle_connections_make_room_for_probes_and_working_clients(start_fleet):
    """Issue 20 item 8, bounded: 1,536 descriptors give the listener 256 accept permits; 5
    addresses, each far under the per-client cap, open 320 idle connections. Near the limit the
    router closes the longest-idle ones, so /health answers at once (it waited for the 60 s idle
    timeout before) and a stream opened before the flood runs to its end."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=12, cadence_s=0.25)
    router = start_fleet(box, extra_args=("--idle-timeout", "60"), nofile=1536)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_from, router, "127.0.0.20")
        time.sleep(0.3)
        socks = [s for i in range(5) for s in open_idle(router, f"127.0.0.{21 + i}", 64)]
        try:
            worst_s = 0.0
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert health(router, timeout=20) == 200
                worst_s = max(worst_s, time.monotonic() - started)
                time.sleep(0.1)
            print(f"worst /health with 320 idle sockets from 5 addresses, 256 permits: {worst_s * 1000:.0f} ms")
            # real time: accepts and closes in the router process; it waited out the 60 s
            # idle timeout before, so a sixth of it is generous and still tells them apart
            assert worst_s < 10
            assert stream.result().rstrip().endswith(b"data: [DONE]")
            held = sum(held_from(router, f"127.0.0.{21 + i}") for i in range(5))
            assert held <= 256 and "near a listener's limit of 256" in router.log_text()
        finally:
            for sock in socks:
                sock.close()


def reopening_flood(target: tuple[str, int], sources: list[str], per_source: int, stop: threading.Event,
                    *, seconds: float, max_opens: int) -> int:
    """`per_source` idle sockets from each of `sources`, each one the router closes opened again
    at once from the same address: a flood that takes back the permits the drain frees. Runs
    until `stop` is set, `seconds` have passed or `max_opens` sockets were opened again; closes
    every socket it opened. Returns how many it opened again."""
    sel = selectors.DefaultSelector()

    def open_one(source: str) -> None:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        sock.connect_ex(target)
        sel.register(sock, selectors.EVENT_READ, source)  # readable: closed by the router (or refused)

    reopened = 0
    deadline = time.monotonic() + seconds
    try:
        for source in sources:
            for _ in range(per_source):
                open_one(source)
        while not stop.is_set() and time.monotonic() < deadline and reopened < max_opens:
            for key, _ in sel.select(0.05):
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_one(key.data)
                reopened += 1
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return reopened


def probe(url: str, timeout: float) -> float | None:
    """GET `url`/health: the seconds it took to answer 200, None when it did not within `timeout`."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
            return time.monotonic() - started if response.status == 200 else None
    except OSError:  # urllib's URLError and the socket's timeout are OSErrors
        return None


def test_the_health_port_answers_probes_while_a_reopening_flood_holds_the_main_port(start_fleet):
    """Issue 36 item 13: 8 addresses x 200 idle sockets, each under the per-client cap, opened
    again as fast as the drain closes them, against 256 accept permits and a backlog of 1,024:
    the main port's accept queue stays full, so a probe there waits behind the flood or its SYN
    is dropped. The health listener (loopback, permits of its own) answers each probe at once."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet(box, extra_args=("--idle-timeout", "60", "--health-port", "auto"), nofile=1536)
    sources = [f"127.0.0.{40 + i}" for i in range(8)]
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        flood = pool.submit(reopening_flood, address(router), sources, 200, stop, seconds=60, max_opens=50_000)
        try:
            assert wait_for(lambda: sum(held_from(router, s) for s in sources) >= 200, timeout=15, interval=0.25)
            main, health_port = [], []
            for _ in range(7):
                main.append(probe(router.url, timeout=1.0))
                health_port.append(probe(router.urls["health"], timeout=5.0))
            print(f"/health under a reopening flood, s (None: no answer in 1 s): main port {main}, "
                  f"health port {health_port}")
            # The flood works: on the main port most probes wait out their second...
            assert sum(took is None for took in main) >= 4, main
            # ...while every probe of the health port answers at once (real time: a dropped SYN
            # is sent again after 1 s, so under a second is a probe the flood did not hold up).
            assert all(took is not None and took < 1.0 for took in health_port), health_port
        finally:
            stop.set()
            reopened = flood.result()
    assert reopened > 0  # the drain closed flood sockets and the flood took their places again


def test_the_health_port_serves_health_only_on_loopback(start_fleet_in_process):
    """The health listener is no way around the main port: every other path is a 404 there,
    inference and the admin API included; it binds loopback whatever --host is."""
    box = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(box, extra_args=("--host", "127.0.0.2", "--health-port", "auto"))
    health_url = urlsplit(router.urls["health"])
    assert urlsplit(router.url).hostname == "127.0.0.2" and health_url.hostname == "127.0.0.1"
    assert f"health listening on {router.urls['health']} (asgi, up to 64 connections)" in router.log_text()
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    conn = http.client.HTTPConnection(health_url.hostname, health_url.port, timeout=10)
    try:
        for method, path, status in [("GET", "/health", 200), ("HEAD", "/health", 200),
                                     ("POST", "/v1/chat/completions", 404), ("POST", "/chat/completions", 404),
                                     ("GET", "/v1/keys", 404), ("POST", "/v1/keys", 404),
                                     ("GET", "/v1/models", 404), ("GET", "/metrics", 404),
                                     ("GET", "/v1/router/state", 404), ("POST", "/api/chat", 404),
                                     ("GET", "/", 404)]:
            conn.request(method, path, body=chat if method == "POST" else None,
                         headers={"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            assert answer.status == status, (method, path)
    finally:
        conn.close()
    assert not [call for call in box.calls if call.path == "/v1/chat/completions"]  # none reached the box


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
            sock.settimeout(10)
            assert sock.recv(4096) == b""  # closed by the router
        # real time: Granian's idle timer in the router process (1 s); never closed would time out
        assert time.monotonic() - started < 5
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


def packed(text: str) -> bytes:
    return ipaddress.ip_address(text).packed


def test_over_cap_closes_the_longest_idle_and_spares_working_ones_and_trusted_proxies():
    a, a6, b, v6, proxy = (packed(t) for t in ("10.0.0.1", "::ffff:10.0.0.1", "10.0.0.2", "2001:db8::1", "10.0.0.9"))
    conns = [Conn(a, 1, 9000, True), Conn(a, 2, 1100, False), Conn(a, 3, 5000, False),
             Conn(a, 4, 5000, False), Conn(a, 5, 0, True)]
    conns += [Conn(a6, 9, 7000, False)]  # the same client through a dual-stack listener
    conns += [Conn(b, 7, 1001, False), Conn(v6, 8, 1010, False), Conn(v6, 6, 1020, False)]
    conns += [Conn(proxy, i, 99_999, False) for i in (11, 12, 13)]
    proxies = [ipaddress.ip_network("10.0.0.9/32")]
    # 10.0.0.1 holds 6, cap 3: its 3 longest idle go (7000, then 5000 twice: the older first).
    assert over_cap(conns, 3, proxies) == [9, 3, 4]
    assert over_cap(conns, 0, proxies) == []
    # Cap 1: every idle one of 10.0.0.1 goes, its two working ones stay, though over the cap.
    assert sorted(over_cap(conns, 1, [])) == [2, 3, 4, 6, 9, 11, 12]
    # One that carried data within FRESH_MS stays too: its request may be read and not yet started...
    fresh = [c._replace(idle_ms=FRESH_MS - 1) if c.conn_id in (2, 3) else c for c in conns]
    assert sorted(over_cap(fresh, 1, [])) == [4, 6, 9, 11, 12]
    # ...until the looks have found it not working for FRESH_MS: a head trickled a byte at a time.
    trickling = [c._replace(unstarted_ms=FRESH_MS) if c.conn_id == 2 else c for c in fresh]
    assert sorted(over_cap(trickling, 1, [])) == [2, 4, 6, 9, 11, 12]


def test_near_limit_drains_the_longest_idle_down_to_the_low_mark():
    conns = [Conn(packed(f"10.0.0.{i % 7}"), i, FRESH_MS + i * 10, i % 5 == 0) for i in range(1, 101)]
    assert near_limit(conns, 200) == []  # 100 of 200: far from the limit
    assert near_limit(conns, 112) == []  # 100 < 0.9 * 112
    drained = near_limit(conns, 110)  # 100 >= 99: down to 88
    assert len(drained) == 12 and drained == [i for i in range(100, 0, -1) if i % 5][:12]
    assert near_limit(conns, 110, closing=range(1, 20)) == []  # rule 3 already took 19
    # 30 wait in the accept queue: room for them below 88, so down to 58; never below 55.
    assert len(near_limit(conns, 110, waiting=30)) == 100 - 58
    assert len(near_limit(conns, 110, waiting=500)) == 100 - 55
    assert near_limit([Conn(b"\x7f\0\0\1", 1, FRESH_MS, True)] * 10, 10) == []  # none idle
    assert near_limit([Conn(b"\x7f\0\0\1", i, FRESH_MS - 1, False) for i in range(10)], 10) == []  # none idle long
    assert near_limit(conns, 0) == []


def reference_close(conns: list[Conn], cap: int, proxies, limit: int, waiting: int) -> tuple[set[int], set[int]]:
    """The docstring's rules applied literally: one connection at a time, the longest idle first."""
    def key(c: Conn):
        return (-c.idle_ms, c.conn_id)

    def closable(c: Conn) -> bool:
        return not c.working and (c.idle_ms >= FRESH_MS or c.unstarted_ms >= FRESH_MS)

    over: set[int] = set()
    if cap > 0:
        for peer in {peer_key(c.peer) for c in conns}:
            if any(ipaddress.ip_address(peer) in net for net in proxies):
                continue
            group = [c for c in conns if peer_key(c.peer) == peer]
            while len(group) > cap and any(closable(c) for c in group):
                victim = min((c for c in group if closable(c)), key=key)
                group.remove(victim)
                over.add(victim.conn_id)
    left = [c for c in conns if c.conn_id not in over]
    near: set[int] = set()
    if limit > 0 and len(left) >= limit * 0.9:
        while len(left) > max(int(limit * 0.8) - waiting, int(limit * 0.5)) and any(closable(c) for c in left):
            victim = min((c for c in left if closable(c)), key=key)
            left.remove(victim)
            near.add(victim.conn_id)
    return over, near


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["10.0.0.1", "::ffff:10.0.0.1", "10.0.0.2", "10.0.0.9", "::1"]),
                       st.sampled_from([0, 10, FRESH_MS - 1, FRESH_MS, FRESH_MS + 10, 5 * FRESH_MS]),
                       st.booleans(), st.sampled_from([0, FRESH_MS - 1, FRESH_MS])), max_size=40),
    st.integers(0, 6), st.integers(0, 45), st.integers(0, 30),
)
def test_the_cap_and_the_drain_match_the_reference(rows, cap, limit, waiting):
    conns = [Conn(packed(peer), conn_id, idle_ms, working, unstarted_ms)
             for conn_id, (peer, idle_ms, working, unstarted_ms) in enumerate(rows)]
    proxies = [ipaddress.ip_network("10.0.0.9/32")]
    over = over_cap(conns, cap, proxies)
    near = near_limit(conns, limit, over, waiting)
    assert (set(over), set(near)) == reference_close(conns, cap, proxies, limit, waiting)
    assert len(set(over) | set(near)) == len(over) + len(near)
    assert not any(c.working or max(c.idle_ms, c.unstarted_ms) < FRESH_MS for c in conns if c.conn_id in {*over, *near})


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
    assert time.monotonic() - started > 2.5  # both outlasted the timeout (real time: a lower bound)
