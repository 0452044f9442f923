"""Faults: what a production front door must do when boxes, connections and clients misbehave.

Each test starts the real router (in this process, tests/inproc.py; as a `router serve` process
where a signal is the point) in front of simulated hugpy boxes whose faults are scripted per call (`router.sim.behavior.Behavior`), and checks three things: what the client
sees, what the box saw (its `CallRecord`s), and the router's own record of the call (the
route_log row read through the admin cursor).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import ollama
import openai
import pytest

from router.boxes.fleet import WATCH_INTERVAL_S
from router.boxes.hugpy import POLL_WAIT_S
from router.core.lifecycle import Event
from router.serve import attempt as attempt_mod
from router.sim import SimOllama
from router.sim.hugpy import Behavior, SimBox
from router.store import db

from conftest import ROOT, wait_for
from inproc import InProcessRouter
from support.boxes import box_calls
from support.calls import MESSAGES
from support.raw_calls import (address, assert_openai_error, chat_body, client, error_lines, hang_up, open_raw,
                               post_chat, raw_request, read_until, request, row_of, rows)

pytestmark = pytest.mark.timeout(30)

# ---------------------------------------------------------------------------------------------
# helpers


def store_rows(router) -> list[dict]:
    """Every route_log row straight from the store (for a router that has exited)."""
    conn = db.open_store(router.boxes_path.parent / "home" / "router.sqlite3")
    try:
        names = None
        out = []
        cursor = conn.execute("SELECT * FROM route_log ORDER BY id")
        for row in cursor:
            if names is None:
                names = [d[0] for d in cursor.getdescription()]
            out.append(dict(zip(names, row)))
        return out
    finally:
        conn.close()


def per_call_id(*boxes: SimBox) -> dict[tuple[str, str], int]:
    """How many times each box saw each router call id (`X-Hugpy-Parent-Request-Id`)."""
    seen: dict[tuple[str, str], int] = {}
    for box in boxes:
        for call in box_calls(box):
            seen[(box.name, call.parent_id)] = seen.get((box.name, call.parent_id), 0) + 1
    return seen


# ---------------------------------------------------------------------------------------------
# A box failing after the first byte


@pytest.mark.parametrize("clean", [True, False], ids=["fin", "rst"])
def test_a_box_dying_mid_stream_ends_the_stream_with_an_error_frame(start_fleet_in_process, clean):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=6, cadence_s=0.02)
    b = SimBox("b", catalog=["tiny"])  # could serve, but nothing is rerouted after the first byte
    a.script("tiny", Behavior.die_after(2, clean=clean))
    router = start_fleet_in_process(a, b)
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=True)
    assert raw.headers["x-hugpy-box"] == "a"
    call_id = raw.headers["x-hugpy-router-request-id"]
    pieces = []
    with pytest.raises(openai.APIError) as info:  # the in-band error frame, never a clean end
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) == 2
    assert info.value.body["code"] == "box_failed"
    row = row_of(router, call_id)
    assert (row["state"], row["error"], row["box"]) == ("failed", "box_failed_mid_stream", "a")
    assert not box_calls(b)
    assert not error_lines(router)


def test_a_box_dying_mid_stream_raw_bytes_end_with_the_error_frame_and_no_done(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=4)
    a.script("tiny", Behavior.die_after(1))
    router = start_fleet_in_process(a)
    status, headers, data = post_chat(router, stream=True)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    frames = [f for f in data.split(b"\n\n") if f]
    assert b"[DONE]" not in data
    assert json.loads(frames[-1].removeprefix(b"data: "))["error"]["code"] == "box_failed"


@pytest.mark.parametrize("cadence_s", [
    pytest.param(0.0, id="done-in-the-first-read"),
    pytest.param(0.05, id="done-in-the-relay"),
])
def test_a_stream_delivered_in_full_is_done_even_if_the_client_hangs_up_after_done(start_fleet_in_process, cadence_s):
    """The openai client hangs up right after `data: [DONE]`; a hugpy stream is close-delimited,
    so the router may still be waiting for the box's EOF. That is a finished call, not a
    cancelled one, and the box must not be told to cancel it. Without a cadence the whole
    stream, [DONE] included, comes in the router's first read (the first-frame gate's path)."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=3, cadence_s=cadence_s)
    a.script("tiny", Behavior.linger(1.0))  # the box closes 1 s after [DONE]
    router = start_fleet_in_process(a)
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=True)
    pieces = [c for c in raw.parse() if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 3  # the client got everything, [DONE] included, and closed
    call_id = raw.headers["x-hugpy-router-request-id"]
    row = row_of(router, call_id, timeout=3)
    assert (row["state"], row["error"]) == ("done", None)
    assert call_id not in a.cancels  # nor is the box told to cancel a call it finished


def test_an_ollama_box_dying_mid_stream_ends_the_ndjson_stream_with_an_error_line(start_fleet_in_process):
    ol = SimOllama("ol", tags=["llama3"], loaded=["llama3"], chunks=5, cadence_s=0.01)
    ol.script("llama3", Behavior.die_after(2))
    router = start_fleet_in_process(ol)
    pieces = []
    with pytest.raises(ollama.ResponseError) as info:
        for part in ollama.Client(host=router.url, timeout=15).chat(model="llama3", messages=MESSAGES, stream=True):
            pieces.append(part.message.content)
    assert len(pieces) == 2 and "mid-stream" in str(info.value)
    (row,) = wait_for(lambda: rows(router), 3)
    assert (row["facade"], row["state"], row["error"]) == ("ollama", "failed", "box_failed_mid_stream")


def test_a_trickling_box_is_relayed_whole_not_taken_for_a_dead_one(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=4)
    a.script("tiny", Behavior.trickle(64, 0.01))  # ~1.1 KB at 6.4 KB/s: every frame arrives in pieces
    router = start_fleet_in_process(a, extra_args=("--first-byte-timeout", "1"))
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=True)
    pieces = [c.choices[0].delta.content for c in raw.parse() if c.choices and c.choices[0].delta.content]
    assert pieces == ["tok "] * 4
    row = row_of(router, raw.headers["x-hugpy-router-request-id"])
    assert row["state"] == "done" and len(row["attempts"]) == 1


# ---------------------------------------------------------------------------------------------
# Before the first byte: timeouts and broken heads fail over


@pytest.mark.parametrize("stream", [False, True], ids=["hang-no-head", "stream-head-then-cold-load"])
def test_no_first_byte_within_the_timeout_fails_over(start_fleet_in_process, stream):
    if stream:
        # A stream's head goes out before placement; a 5 s cold load is silence after it.
        a = SimBox("a", catalog=["tiny"], load_s=5)
        b = SimBox("b", catalog=["tiny"])
    else:
        a = SimBox("a", catalog=["tiny"], residents=["tiny"])
        b = SimBox("b", catalog=["tiny"])
        a.script("tiny", Behavior.hang(5))
    router = start_fleet_in_process(a, b, extra_args=("--first-byte-timeout", "1"))
    started = time.monotonic()
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=stream)
    assert raw.headers["x-hugpy-box"] == "b"
    if stream:
        assert [c for c in raw.parse() if c.choices and c.choices[0].delta.content]
    else:
        assert raw.parse().choices[0].message.content
    # real time: the timeout of a real attempt that fails over to another box (a stepped clock
    # would also step past b's fresh deadline); a lower bound, which load cannot break. That it
    # fired before a's 5 s answer, the attempts say.
    assert time.monotonic() - started > 0.9
    row = row_of(router, raw.headers["x-hugpy-router-request-id"])
    assert [(att["box"], att.get("refusal")) for att in row["attempts"]] == [("a", "first_byte_timeout"), ("b", None)]
    assert row["state"] == "done"
    # The router gave up on a's call: it closed that connection, so a stopped working on it.
    (abandoned,) = box_calls(a)
    assert wait_for(lambda: abandoned.finished_at is not None, 3)
    assert abandoned.client_closed_at is not None  # the router left before a answered


def test_an_invalid_http_head_fails_over_and_is_recorded(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.bad_head())
    router = start_fleet_in_process(a, b)
    status, headers, data = post_chat(router)
    assert status == 200 and headers["x-hugpy-box"] == "b", data
    row = row_of(router, headers["x-hugpy-router-request-id"])
    assert [(att["box"], att.get("refusal")) for att in row["attempts"]] == [("a", "bad_response"), ("b", None)]
    # Alone, the same fault is a clean 502 in OpenAI's shape.
    a.script("tiny", Behavior.bad_head())
    status, _, data = post_chat(router, headers={"X-Router-Box": "a"})
    assert status == 502 and assert_openai_error(status, data)["code"] == "bad_response"
    assert post_chat(router, headers={"X-Router-Box": "a"})[0] == 200  # and a is not poisoned
    assert not error_lines(router)


# ---------------------------------------------------------------------------------------------
# Stale keep-alive connections (upstream.pool rule 3)


def _spaced_calls(router, count: int, gap_s: float) -> list[tuple[int, dict, bytes]]:
    answers = []
    for _ in range(count):
        time.sleep(gap_s)
        answers.append(post_chat(router))
    return answers


def test_a_stale_pooled_connection_never_fails_a_call_the_box_never_started(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    # The box's idle close meets every request sent on a connection idle for over 0.15 s: it
    # drops the request unread (so it never starts the call) and closes. The router keeps idle
    # connections 4 s, so each spaced call is sent on such a connection.
    a.close_idle_after(0.15, timer=False)
    router = start_fleet_in_process(a)
    answers = _spaced_calls(router, 4, 0.4)
    assert a.idle_races > 0  # the race happened
    assert [status for status, _, _ in answers] == [200] * 4, [data for _, _, data in answers]
    assert all(n == 1 for n in per_call_id(a).values())


def test_a_stale_connection_race_fails_over_to_another_box_and_never_repeats_a_body(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])  # serving: always tried first
    b = SimBox("b", catalog=["tiny"])
    a.close_idle_after(0.15, timer=False)
    router = start_fleet_in_process(a, b)
    answers = _spaced_calls(router, 4, 0.4)
    assert a.idle_races > 0
    assert [status for status, _, _ in answers] == [200] * 4, [data for _, _, data in answers]
    assert all(n == 1 for n in per_call_id(a, b).values())


def test_a_box_closing_idle_connections_on_time_never_fails_a_call(start_fleet_in_process):
    """The everyday case: the box's idle timer (0.25 s here, 5 s in uvicorn and Go) is shorter
    than the router's 4 s, and calls come at every spacing around it."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.close_idle_after(0.25)
    router = start_fleet_in_process(a)
    answers = [post_chat(router)]
    for gap_ms in range(200, 320, 10):
        time.sleep(gap_ms / 1000)
        answers.append(post_chat(router))
    assert a.idle_closes > 0
    assert all(status == 200 for status, _, _ in answers), [data for _, _, data in answers]
    assert all(n == 1 for n in per_call_id(a).values())


@pytest.mark.parametrize("fault", [
    pytest.param(Behavior.reset(), id="rst-at-once"),
    pytest.param(Behavior.drop(0.3, clean=True), id="fin-later"),
])
def test_a_body_the_box_took_is_never_sent_to_it_twice(start_fleet_in_process, fault):
    """The box read the call, then its connection broke before any answer byte, on a reused
    connection (the look of a stale close): another box may take it, never the same one again.
    (A FIN at once, with nothing read, is the stale race itself; a box that read the call and
    then closed at once cannot be told from it on the wire, so that case is not pinned.)"""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    router = start_fleet_in_process(a, b)
    assert post_chat(router)[1]["x-hugpy-box"] == "a"  # a's pool now holds a warm connection
    a.script("tiny", fault)
    status, headers, data = post_chat(router)
    assert status == 200 and headers["x-hugpy-box"] == "b", data
    assert all(n == 1 for n in per_call_id(a, b).values())
    # Pinned to a, the same fault fails the call cleanly, once.
    a.script("tiny", fault)
    status, headers, data = post_chat(router, headers={"X-Router-Box": "a"})
    assert status == 502 and assert_openai_error(status, data)["code"] == "connection_lost"
    assert per_call_id(a)[("a", headers["x-hugpy-router-request-id"])] == 1


# ---------------------------------------------------------------------------------------------
# Clients that leave


def test_a_client_leaving_during_a_slow_upload_is_cancelled_and_no_box_is_contacted(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    body = chat_body()
    sock = open_raw(router, body[:20], length=len(body) + 100_000)
    for _ in range(3):
        time.sleep(0.1)
        sock.sendall(b" " * 1000)
    sock.close()
    (row,) = wait_for(lambda: rows(router), 3)
    assert (row["state"], row["error"]) == ("cancelled", "client_left")
    assert not box_calls(a)
    assert request(router, "GET", "/health")[0] == 200


def test_a_client_leaving_while_the_box_is_silent_ends_the_box_call_and_is_cancelled(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    a.script("tiny", Behavior.hang(10))
    router = start_fleet_in_process(a)
    sock = open_raw(router, chat_body())
    (call,) = wait_for(lambda: box_calls(a), 5)
    hang_up(sock, call)
    row = row_of(router, call.parent_id)
    assert (row["state"], row["error"]) == ("cancelled", "client_left")


def test_a_client_leaving_mid_stream_ends_the_box_call_and_is_cancelled(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=100, cadence_s=0.05)
    router = start_fleet_in_process(a)
    sock = open_raw(router, chat_body(stream=True))
    assert b'"tok "' in read_until(sock, b'"tok "')
    (call,) = box_calls(a)
    hang_up(sock, call)
    # The router closes the box connection and, for a hugpy box, always posts the cancel too (a
    # busy box may not notice a closed socket); which of the two the box sees first is a race.
    assert wait_for(lambda: call.parent_id in a.cancels, 2)
    row = row_of(router, call.parent_id)
    assert (row["state"], row["error"]) == ("cancelled", "client_left")
    assert 0 < row["bytes_out"]


def read_answer_head(reader) -> tuple[int, dict[bytes, bytes]]:
    """An answer's status and headers, from a buffered reader over a raw connection."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


def test_calls_back_to_back_on_one_connection_are_answered_and_a_leaving_client_is_noticed(start_fleet_in_process):
    """serve/edge.py invariant 8: a declared body is read to its length, Granian's closing empty
    message left unread. The connection still carries the calls after it (pipelined, one body in
    two pieces), and a client that leaves the last one mid-stream is still noticed by the
    disconnect watcher, whose first receive now gets that closing message."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=100, cadence_s=0.05)
    router = start_fleet_in_process(a)
    plain, stream = raw_request(chat_body()), raw_request(chat_body(stream=True))
    sock = socket.create_connection(address(router))
    reader = sock.makefile("rb")
    sock.sendall(plain + plain[:-10])  # the second body's end comes later
    time.sleep(0.2)
    sock.sendall(plain[-10:] + stream)
    for _ in range(2):
        status, headers = read_answer_head(reader)
        assert status == 200 and json.loads(reader.read(int(headers[b"content-length"])))["choices"]
    status, _ = read_answer_head(reader)
    assert status == 200
    while b'"tok "' not in reader.readline():
        pass
    call_ = wait_for(lambda: next((c for c in box_calls(a) if c.stream), None), 3)
    assert len(box_calls(a)) == 3
    reader.close()  # the socket's descriptor closes with its last user
    hang_up(sock, call_)
    row = row_of(router, call_.parent_id)
    assert (row["state"], row["error"]) == ("cancelled", "client_left")


def test_a_chunked_body_that_also_names_a_length_is_read_whole(start_fleet_in_process):
    """Transfer-Encoding wins over Content-Length (RFC 9112 §6.3): a body whose first chunk is
    as long as the stray Content-Length is still read to its last chunk, never cut there."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    body = chat_body()
    sock = socket.create_connection(address(router))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n" + body[:5] + b"\r\n")
        time.sleep(0.2)  # the first chunk alone, as long as the declared length
        sock.sendall(b"%x\r\n" % (len(body) - 5) + body[5:] + b"\r\n0\r\n\r\n")
        reader = sock.makefile("rb")
        status, headers = read_answer_head(reader)
        assert status == 200 and json.loads(reader.read(int(headers[b"content-length"])))["choices"]
        reader.close()
    finally:
        sock.close()
    assert len(box_calls(a)) == 1  # five bytes alone would have been a 400, never a box's call


def test_a_client_leaving_mid_trickle_ends_the_box_call(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=20)
    a.script("tiny", Behavior.trickle(32, 0.05))  # about 5 s for the whole stream
    router = start_fleet_in_process(a)
    sock = open_raw(router, chat_body(stream=True))
    assert b'"tok "' in read_until(sock, b'"tok "')
    (call,) = box_calls(a)
    hang_up(sock, call)
    assert row_of(router, call.parent_id)["state"] == "cancelled"


# ---------------------------------------------------------------------------------------------
# Boxes going away and coming back


def test_all_boxes_offline_get_clear_refusals_and_the_view_recovers(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"])
    first = start_fleet_in_process(a, b)
    fleet = first.fleet
    assert post_chat(first)[0] == 200
    fleet.stop_box(a)
    fleet.stop_box(b)
    # Still online in the router's view (the health TTL): both are tried, both refuse to connect.
    status, _, data = post_chat(first)
    assert status in (502, 503)
    error = assert_openai_error(status, data)
    assert error["code"] in ("unreachable", "no_box"), error
    assert first.stop() == 0
    assert not error_lines(first)
    # A router that starts while every box is down knows they are offline: 503 no_box, reasons.
    second = InProcessRouter(first.boxes_path)
    try:
        status, _, data = post_chat(second)
        error = assert_openai_error(status, data)
        assert (status, error["code"]) == (503, "no_box")
        assert set(error["reasons"]) == {"a", "b"} and all(r.startswith("offline") for r in error["reasons"].values())
        fleet.start_box(a)
        fleet.start_box(b)
        assert wait_for(lambda: post_chat(second)[0] == 200, 6, 0.25)  # the health loop brings them back
        assert not error_lines(second)
    finally:
        second.stop()


def box_view(router, name: str) -> dict:
    status, _, data = request(router, "GET", "/v1/router/state")
    assert status == 200
    return next(box for box in json.loads(data)["boxes"] if box["name"] == name)


def test_flapping_health_and_a_box_restart_never_fail_a_call(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["tiny"], residents=["tiny"])
    # A process of its own: run in the test process (whose client and flapper threads share the
    # GIL with the router's loop), it once missed the 3 s resync in a loaded full run.
    router = start_fleet(a, b)
    stop = threading.Event()

    def flap() -> None:  # /health answers, then hangs silent, then answers, ...
        while not stop.wait(0.3):
            a.healthy_answer = not a.healthy_answer

    flapper = threading.Thread(target=flap, daemon=True)
    flapper.start()
    statuses: list[int] = []

    def calls_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            statuses.append(post_chat(router)[0])
            time.sleep(0.05)

    try:
        calls_for(1.5)
        # A restart: the counter back to 1, residents gone. The router follows by itself: it
        # says "restarted" when its long-poll sees the low counter, and its view of the box's
        # residents is the box's again. (Under traffic the counter can pass the router's `since`
        # before its next poll, and then the poll answers without a low counter: contracts/
        # hugpy-wrapper.md §2.2. So either sign counts; calls keep flowing meanwhile.)
        a.restart()

        def followed() -> bool:
            calls_for(0.1)
            seen = box_view(router, "a")["residents"]
            return "box a restarted" in router.log_text() or [r["key"] for r in seen] == sorted(a.residents)

        # real time: the router's long-poll on its own loop. A restart answers the pending poll
        # at once; without that the router would learn of it only when the poll ends (10 s).
        assert wait_for(followed, POLL_WAIT_S / 2, 0)
        calls_for(0.5)
    finally:
        stop.set()
        flapper.join()
        a.healthy_answer = True
    assert statuses and all(s == 200 for s in statuses), statuses
    # The view recovers by itself: a online, nothing held, and it serves (and loads) again.
    assert wait_for(lambda: (v := box_view(router, "a"))["online"] and v["in_flight"] == 0
                    and v["reservations"] == 0, 3, 0.1)
    assert post_chat(router, headers={"X-Router-Box": "a"})[0] == 200
    assert wait_for(lambda: [r["key"] for r in box_view(router, "a")["residents"]] == ["tiny"], 3, 0.1)
    assert not error_lines(router)


# ---------------------------------------------------------------------------------------------
# The boxes file edited while serving


def run_boxes(router, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router", "boxes", "--boxes-file", str(router.boxes_path), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=20,
    )
    assert done.returncode == 0, done.stderr


def test_boxes_file_edits_apply_at_the_next_watch_and_never_drop_a_call_in_flight(start_fleet_in_process):
    """Real time: the file watch is the router's own loop, and the edit a `router boxes` process.
    Each edit must show within a few watch intervals (docs/boxes.md: within a second); an
    unwatched file would never show it."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=60, cadence_s=0.07)  # a ~4 s stream
    b = SimBox("b", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    router.fleet.boxes.append(b)
    router.fleet.start_box(b)  # b runs, but the router does not know it yet
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def long_stream() -> tuple[str, int]:
            raw = client(router).chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, stream=True)
            pieces = [c for c in raw.parse() if c.choices and c.choices[0].delta.content]
            return raw.headers["x-hugpy-box"], len(pieces)
        in_flight = pool.submit(long_stream)
        assert wait_for(lambda: box_calls(a), 3)

        def pinned(name: str) -> tuple[int, bytes]:
            status, _, data = post_chat(router, headers={"X-Router-Box": name})
            return status, data

        run_boxes(router, "add", "--name", "b", "--url", b.url)
        assert wait_for(lambda: pinned("b")[0] == 200, 4 * WATCH_INTERVAL_S, 0.1)

        run_boxes(router, "block", "a")
        assert wait_for(lambda: json.loads(pinned("a")[1]).get("error", {}).get("reasons", {}).get("a") == "blocked",
                        4 * WATCH_INTERVAL_S, 0.1)
        before = len(box_calls(a))
        assert all(post_chat(router)[1]["x-hugpy-box"] == "b" for _ in range(3))
        assert len(box_calls(a)) == before

        run_boxes(router, "remove", "a")
        assert wait_for(lambda: json.loads(pinned("a")[1]).get("error", {}).get("reasons", {}).get("a", "")
                        .startswith("unknown_box"), 4 * WATCH_INTERVAL_S, 0.1)
        assert in_flight.result(15) == ("a", 60)  # the stream that started on a finished whole
    row = wait_for(lambda: next((r for r in rows(router) if r["box"] == "a" and r["stream"]), None), 3, 0.05)
    assert row is not None and row["state"] == "done"
    assert not error_lines(router)


# ---------------------------------------------------------------------------------------------
# SIGTERM under load


def test_sigterm_under_load_finishes_calls_in_flight_and_records_every_one(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=20, cadence_s=0.05)  # ~1 s streams
    router = start_fleet(a)
    for _ in range(3):
        a.script("tiny", Behavior.hang(1.0))  # the non-stream calls: a second of silence each

    def stream_call() -> tuple[str, int, bool]:
        # Read to the end of the answer, as curl does (the openai client hangs up right after
        # [DONE], which races the router's own end of the call: see the [DONE] test above).
        status, headers, data = post_chat(router, stream=True)
        assert status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-200:]
        return headers["x-hugpy-router-request-id"], data.count(b'"tok "'), True

    def plain_call() -> tuple[str, int, bool]:
        raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES)
        return raw.headers["x-hugpy-router-request-id"], raw.http_response.status_code, False

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        # Scripts are taken in arrival order: send the plain calls first.
        plain = [pool.submit(plain_call) for _ in range(3)]
        assert wait_for(lambda: len(box_calls(a)) == 3, 5)
        streams = [pool.submit(stream_call) for _ in range(3)]
        assert wait_for(lambda: len(box_calls(a)) == 6, 5)
        router.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Stopped accepting: a new connection is refused or gets no answer.
        try:
            late = post_chat(router, timeout=3)[0]
        except OSError:
            late = None
        answers = [f.result(10) for f in plain + streams]
    assert router.proc.wait(10) == 0
    assert late is None, f"a call after SIGTERM was answered {late}"
    assert [n for _, n, is_stream in answers if not is_stream] == [200] * 3
    assert [n for _, n, is_stream in answers if is_stream] == [20] * 3
    recorded = {row["request_id"]: row for row in store_rows(router)}
    for call_id, _, _ in answers:
        assert recorded[call_id]["state"] == "done"
    assert not error_lines(router)


# ---------------------------------------------------------------------------------------------
# A box cutting a relayed (unframed) answer


BIG = bytes(range(256)) * 8192  # 2 MiB: over the inline limit, so it is relayed as it arrives


def _speech_through(router) -> tuple[int, bytes | None, str]:
    """POST /v1/audio/speech; (status, body or None when the client could tell it was cut, call id)."""
    conn = http.client.HTTPConnection(*address(router), timeout=10)
    try:
        conn.request("POST", "/v1/audio/speech", body=json.dumps({"model": "kokoro", "input": "x", "voice": "af"}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        call_id = resp.getheader("x-hugpy-router-request-id")
        try:
            data = resp.read()
        except (http.client.IncompleteRead, OSError):
            data = None  # the client can tell the answer is cut: what a front door must make happen
        return resp.status, data, call_id
    finally:
        conn.close()


@pytest.mark.parametrize("clean", [True, False], ids=["fin", "rst"])
def test_a_sized_answer_cut_mid_body_never_reaches_the_client_as_complete(start_fleet_in_process, clean):
    a = SimBox("a", catalog=["kokoro"], residents=["kokoro"])
    a.script("kokoro", Behavior.cut(200, [("Content-Type", "audio/wav")], BIG, len(BIG) // 2, clean=clean))
    router = start_fleet_in_process(a)
    status, data, call_id = _speech_through(router)
    row = row_of(router, call_id)
    assert (row["state"], row["error"]) == ("failed", "box_failed_mid_stream")
    assert status == 200
    assert data is None or data == BIG, f"a cut answer ended cleanly: {len(data)} of {len(BIG)} bytes"


def test_a_close_delimited_answer_reset_mid_body_is_a_failure_not_a_complete_answer(start_fleet_in_process):
    a = SimBox("a", catalog=["kokoro"], residents=["kokoro"])
    a.script("kokoro", Behavior.cut(200, [("Content-Type", "audio/wav")], BIG, len(BIG) // 2,
                                    clean=False, length=False))
    router = start_fleet_in_process(a)
    status, data, call_id = _speech_through(router)
    row = row_of(router, call_id)
    assert (row["state"], row["error"]) == ("failed", "box_failed_mid_stream")
    assert data is None or data == BIG, f"a cut answer ended cleanly: {len(data)} of {len(BIG)} bytes"


def test_a_close_delimited_answer_ended_by_fin_is_complete(start_fleet_in_process):
    """The other side of the rule: without a length, an orderly close is the end of the body."""
    a = SimBox("a", catalog=["kokoro"], residents=["kokoro"])
    a.script("kokoro", Behavior.cut(200, [("Content-Type", "audio/wav")], BIG, len(BIG) // 2, length=False))
    router = start_fleet_in_process(a)
    status, data, call_id = _speech_through(router)
    assert (status, data) == (200, BIG[: len(BIG) // 2])
    assert row_of(router, call_id)["state"] == "done"


# ---------------------------------------------------------------------------------------------
# Every owner refused: the status the last refusal stands for, never a 200 carrying an error


@pytest.mark.parametrize(("type_", "code", "status"), [
    pytest.param("load_error", 503, 503, id="load-error"),  # hugpy-wrapper 0.1.182, a model that fails to load
    pytest.param("not_found_error", 404, 404, id="not-found"),
    pytest.param("worker_reserved", 423, 423, id="reserved"),
    pytest.param("insufficient_resources", "won't fit", 503, id="no-numeric-code"),
])
def test_a_stream_whose_only_owner_refuses_in_band_gets_that_status(start_fleet_in_process, type_, code, status):
    a = SimBox("a", catalog=["tiny"])
    a.script("tiny", Behavior.in_band(type_, "load failed: child exited rc=1", code=code))
    router = start_fleet_in_process(a)
    with pytest.raises(openai.APIStatusError) as info:
        client(router).chat.completions.create(model="tiny", messages=MESSAGES, stream=True)
    error = info.value
    assert error.status_code == status
    assert (error.body["type"], error.body["code"]) == (type_, code)  # the box's error object, kept
    assert error.code == str(code)  # (the openai client reads `code` as a string)
    assert error.message.endswith("load failed: child exited rc=1")
    assert error.response.headers["content-type"] == "application/json"
    assert error.response.headers["x-hugpy-box"] == "a"
    row = row_of(router, error.response.headers["x-hugpy-router-request-id"])
    assert (row["state"], row["http_status"], row["error"]) == ("failed", status, type_)


def test_every_owner_refusing_in_band_answers_the_last_refusal(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])  # serving: tried first
    b = SimBox("b", catalog=["tiny"])
    a.script("tiny", Behavior.in_band("insufficient_resources", "won't fit"))
    b.script("tiny", Behavior.in_band("load_error", "load failed"))
    router = start_fleet_in_process(a, b)
    status, headers, data = post_chat(router, stream=True)
    error = assert_openai_error(status, data)
    assert (status, error["type"], error["code"], headers["x-hugpy-box"]) == (503, "load_error", 503, "b")
    row = row_of(router, headers["x-hugpy-router-request-id"])
    assert [(att["box"], att["refusal"]) for att in row["attempts"]] == [
        ("a", "insufficient_resources"), ("b", "load_error")]


def test_an_ollama_stream_whose_only_owner_errs_in_its_first_line_is_a_502(start_fleet_in_process):
    ol = SimOllama("ol", tags=["llama3"], loaded=["llama3"])
    ol.script("llama3", Behavior.in_band(message="an error was encountered while running the model"))
    router = start_fleet_in_process(ol)
    with pytest.raises(ollama.ResponseError) as info:
        list(ollama.Client(host=router.url, timeout=15).chat(model="llama3", messages=MESSAGES, stream=True))
    assert info.value.status_code == 502
    assert info.value.error == "an error was encountered while running the model"
    (row,) = wait_for(lambda: rows(router), 3)
    assert (row["state"], row["http_status"], row["error"]) == ("failed", 502, "stream_error")


# ---------------------------------------------------------------------------------------------
# A box silent after the first byte (--stream-idle-timeout)

IDLE_TIMEOUT = ("--stream-idle-timeout", "0.4")


def test_a_box_silent_mid_stream_ends_it_with_an_error_frame_and_is_cancelled(start_fleet_in_process):
    """The idle deadline on the router's call clock, stepped ahead (tests/inproc.py
    advance_clock): a minute's timeout, not yet due a second before it, due a second after."""
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=5)
    a.script("tiny", Behavior.stall_after(2, 600))
    router = start_fleet_in_process(a, extra_args=("--stream-idle-timeout", "60"))
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=True)
    call_id = raw.headers["x-hugpy-router-request-id"]
    pieces = []

    def read_all() -> None:
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_all)
        assert wait_for(lambda: len(pieces) == 2, 5)  # the box went silent after two frames
        router.advance_clock(0)  # a look at the silence: its minute starts now
        router.advance_clock(59)
        assert not reading.done()
        router.advance_clock(61)
        with pytest.raises(openai.APIError) as info:  # the in-band error frame, never a clean end
            reading.result(5)
    assert len(pieces) == 2 and info.value.body["code"] == "stream_idle_timeout"
    (call,) = box_calls(a)
    assert wait_for(lambda: call.finished_at is not None, 2)  # the box connection was closed
    assert wait_for(lambda: call_id in a.cancels, 2)  # and the box was told
    row = row_of(router, call_id)
    assert (row["state"], row["error"], row["box"]) == ("failed", "stream_idle_timeout", "a")
    assert not error_lines(router)


def test_an_ollama_box_silent_mid_stream_ends_the_ndjson_stream_with_an_error_line(start_fleet_in_process):
    ol = SimOllama("ol", tags=["llama3"], loaded=["llama3"], chunks=5)
    ol.script("llama3", Behavior.stall_after(2, 20))
    router = start_fleet_in_process(ol, extra_args=IDLE_TIMEOUT)
    pieces = []
    with pytest.raises(ollama.ResponseError) as info:
        for part in ollama.Client(host=router.url, timeout=15).chat(model="llama3", messages=MESSAGES, stream=True):
            pieces.append(part.message.content)
    assert len(pieces) == 2 and "silent mid-stream" in str(info.value)
    (row,) = wait_for(lambda: rows(router), 3)
    assert (row["facade"], row["state"], row["error"]) == ("ollama", "failed", "stream_idle_timeout")
    (call,) = [c for c in ol.calls if c.path == "/api/chat"]
    assert wait_for(lambda: call.finished_at is not None, 2)


def test_a_box_silent_mid_body_cuts_the_sized_answer(start_fleet_in_process):
    a = SimBox("a", catalog=["kokoro"], residents=["kokoro"])
    a.script("kokoro", Behavior.stall_body(200, [("Content-Type", "audio/wav")], BIG, len(BIG) // 2, 20))
    router = start_fleet_in_process(a, extra_args=IDLE_TIMEOUT)
    status, data, call_id = _speech_through(router)
    assert status == 200 and data is None  # the client can tell the answer was cut
    row = row_of(router, call_id)
    assert (row["state"], row["error"]) == ("failed", "stream_idle_timeout")
    assert wait_for(lambda: call_id in a.cancels, 2)


def test_a_slow_but_steady_stream_is_not_taken_for_a_silent_one(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=6, cadence_s=0.25)  # 1.5 s in all
    router = start_fleet_in_process(a, extra_args=IDLE_TIMEOUT)
    raw = client(router).chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, stream=True)
    assert len([c for c in raw.parse() if c.choices and c.choices[0].delta.content]) == 6
    assert row_of(router, raw.headers["x-hugpy-router-request-id"])["state"] == "done"



@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_as_its_box_answers_logs_no_error(start_fleet_in_process, monkeypatch, stream):
    """Issue 20 item 6: a client that hangs up just as its box's head arrives (2,000 aborts 90-130
    ms into 100 ms answers logged 78 `IllegalTransition: event head in phase ended`). The race,
    made certain: the head is in, then the client leaves (the call ends, its exchange is
    aborted), then the attempt goes on. What arrives after the end is late news
    (router.core.lifecycle rule 2): no ERROR line, no traceback, one `cancelled` row."""
    judge = attempt_mod.Attempt.judge

    async def judge_after_the_client_left(self, exchange):
        await exchange.head
        self.life.fire(Event.CLIENT_LEFT)  # what ProxyCall.outside does as the client leaves
        self.abort("client left")
        return await judge(self, exchange)

    monkeypatch.setattr(attempt_mod.Attempt, "judge", judge_after_the_client_left)
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    sock = open_raw(router, chat_body(stream=stream))  # (what it reads is moot: it "left")
    (call,) = wait_for(lambda: box_calls(a), 5)
    row = row_of(router, call.parent_id)
    sock.close()
    assert (row["state"], row["error"]) == ("cancelled", "client_left")
    log = router.log_text()
    assert error_lines(router) == [] and "Traceback" not in log and "IllegalTransition" not in log
