"""The running router: stop under load, live boxes-file edits, box restarts, and what it writes
to its log (never a prompt, a chunk or a key). SIGTERM and the log are read from a `router serve`
process (all of its stderr, not only its logging records); the rest runs in this process."""

from __future__ import annotations

import re
import threading
import time

import httpx

import openai

from router.sim.hugpy import Behavior, SimBox

from conftest import wait_for, write_boxes

CANARY = "CANARY-7f3a9c1e"


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=f"sk-{CANARY}-client", max_retries=0, timeout=30)


def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(start_fleet):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"], chunks=10, cadence_s=0.1)
    router = start_fleet(a)
    received: list[str] = []

    def consume():
        stream = client(router).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)

    reader = threading.Thread(target=consume)
    reader.start()
    assert wait_for(lambda: received, 5)
    router.proc.send_signal(15)
    reader.join(10)
    assert len(received) == 10
    assert router.proc.wait(10) == 0


def test_boxes_file_edits_take_effect_without_a_restart(start_fleet_in_process, tmp_path):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", catalog=["other"], residents=["other"])
    router = start_fleet_in_process(a, b)
    path = router.boxes_path
    write_boxes(path, [a])  # b removed
    def refusal(model: str) -> openai.APIStatusError | None:
        """The router's refusal of a call for `model`, or None when a box served it."""
        try:
            client(router).chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
        except openai.APIStatusError as exc:
            return exc
        return None

    assert wait_for(lambda: (r := refusal("other")) is not None and r.status_code == 503, 4, 0.2)
    write_boxes(path, [a, b], b={"pool": None})
    assert wait_for(lambda: refusal("other") is None, 4, 0.2)
    write_boxes(path, [a, b], a={"blocked": True})
    assert wait_for(lambda: (r := refusal("tiny")) is not None and r.body.get("reasons", {}).get("a") == "blocked",
                    4, 0.2)


def test_a_box_restart_is_seen_and_the_view_resyncs(start_fleet_in_process):
    a = SimBox("a", catalog=["tiny"], residents=["tiny"])
    router = start_fleet_in_process(a)
    def resident_on():
        return {m.id: m.model_extra["resident_on"] for m in client(router).models.list()}["tiny"]
    assert resident_on() == ["a"]
    # A real restart drops the link's pending long-poll with the process; the sim answers it
    # with the reset counter instead, so restart while a long-poll is pending.
    assert wait_for(lambda: a.state_polls >= 2, 3)
    time.sleep(0.1)
    router.fleet.call_soon(a.restart)
    assert wait_for(lambda: resident_on() == [], 3, 0.1)
    client(router).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert wait_for(lambda: resident_on() == ["a"], 3, 0.1)


def test_no_prompt_chunk_or_key_reaches_the_log(start_fleet, tmp_path):
    key = f"hpk_box_{CANARY}-box-key"
    a = SimBox("a", key=key, catalog=["tiny"], residents=["tiny"])
    b = SimBox("b", key=key, catalog=["tiny"])
    chunk = f'data: {{"choices": [{{"index": 0, "delta": {{"content": "{CANARY}-chunk"}}}}]}}\n\n'.encode()
    a.script("tiny", Behavior.refuse(503, "insufficient_resources", f"{CANARY} refusal text"))
    b.script("tiny", Behavior.raw(200, [("Content-Type", "text/event-stream")], chunk + b"data: [DONE]\n\n"))
    router = start_fleet(a, b, extra_args=("--log-level", "debug"))
    stream = client(router).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"{CANARY}-prompt"}], stream=True
    )
    chunks = list(stream)  # to its end: any() would leave the stream for the collector to close
    assert any(CANARY in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    try:  # a refused call: the decision's reasons are logged at debug, the body never
        client(router).chat.completions.create(model="nope", messages=[{"role": "user", "content": CANARY}])
    except openai.APIStatusError:
        pass
    # Affinity: a conversation hashed and matched, session ids and a prompt_cache_key used as keys
    history = [{"role": "system", "content": f"{CANARY}-system"}, {"role": "user", "content": f"{CANARY}-first"}]
    for turn in range(3):
        client(router).chat.completions.create(model="tiny", messages=history)
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"{CANARY}-{turn}"}]
    client(router).chat.completions.create(model="tiny", messages=history, prompt_cache_key=f"{CANARY}-cache-key",
                                           user=f"{CANARY}-user", extra_headers={"X-Router-Session": f"{CANARY}-s"})
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    router.stop()
    log = router.log_text()
    assert "refused" in log  # debug routing lines were written
    assert CANARY not in log
    # nor a hash of one (62-bit: 16 digits or more), in the log, the metrics or the store
    store = b"".join(path.read_bytes() for path in (tmp_path / "home").rglob("*.sqlite3*"))
    for text in (log, metrics, store.decode("latin-1")):
        assert CANARY not in text
        found = re.search(r"(?<![0-9a-f.])[0-9]{16,}(?![0-9a-f])", text)  # (call ids are hex)
        assert found is None, text[found.start() - 300:found.end() + 50]
