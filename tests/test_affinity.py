"""Cache-aware routing end to end (docs/affinity.md): the real router in this process
(tests/inproc.py) in front of simulated hugpy boxes that keep a prefix cache, called through the
official `openai` client. Where a call landed is its `X-Hugpy-Box` header; how its key placed it,
`X-Router-Affinity`.
"""

from __future__ import annotations

import concurrent.futures
import sqlite3
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from router.serve.affinity import scope_of
from router.sim import SimLMStudio
from router.sim.hugpy import SimBox

from conftest import wait_for
from support.conversations import chat, client, first_message

pytestmark = pytest.mark.timeout(90)

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 80}  # ~2 kB, every conversation's


def converse(api: openai.OpenAI, n: int, turns: int) -> list[tuple[str, str | None]]:
    """One conversation, each turn resending the whole history; (box, affinity) per turn."""
    messages = [SYSTEM, first_message(n)]
    landed = []
    for turn in range(turns):
        landed.append(chat(api, messages))
        messages = messages + [{"role": "assistant", "content": f"answer {turn}"},
                               {"role": "user", "content": f"question {turn + 1} of {n}"}]
    return landed


def how_they_landed(router, count: int) -> str:
    """Why the router's last `count` calls went where they did, for a failed assertion: per call
    its box, affinity outcome (`none`: no key), the decision's order with each box's tier, the
    boxes ruled out and why (`no_model`: its inventory not read yet), and its attempts (several:
    a failover); then each box's load parts as the router sees them now (router.core.decide
    rule 4). From the route log and the state, as an operator would read them."""

    def admin(path: str) -> dict:
        return httpx.get(router.url + path, timeout=10).json()

    tail = f"/v1/telemetry?tail={count}"
    rows = wait_for(lambda: rows if len(rows := admin(tail)["rows"]) >= count else None, 5)  # written off the loop
    calls = [(row["box"], row["affinity"], row["decision"]["why"], row["decision"]["refused"],
              [(a["box"], a["status"], a.get("refusal")) for a in row["attempts"]]) for row in rows or ()]
    loads = {box["name"]: {k: box[k] for k in ("online", "unreachable", "in_flight", "pending", "pressure",
                                               "reservations", "placement_refusals")}
             | {"residents": {r["key"]: r["state"] for r in box["residents"]}}
             for box in admin("/v1/router/state")["boxes"]}
    return f"calls (box, affinity, order, ruled out, attempts): {calls}\nboxes now: {loads}"


def boxes(n: int, **kwargs) -> list[SimBox]:
    made = [SimBox(name, residents=["tiny"], **kwargs) for name in "abcd"[:n]]
    for box in made:
        box.prefix_cache.prefill_s_per_token = 0.00002  # an uncached 1k-token prompt: 20 ms
    return made


def test_later_turns_stick_to_their_box_under_concurrency(start_fleet_in_process):
    fleet = boxes(4, cadence_s=0.005)
    router = start_fleet_in_process(*fleet)
    api = client(router)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda n: converse(api, n, 5), range(8)))
    later = [(run[i - 1][0], run[i]) for run in runs for i in range(1, len(run))]
    returned = sum(1 for before, (box, _) in later if box == before)
    hits = sum(1 for _, (_, affinity) in later if affinity == "hit:prefix")
    assert returned >= 0.9 * len(later), runs
    assert hits >= 0.9 * len(later), runs
    assert all(run[0][1] == "miss:prefix" for run in runs)  # a first turn has nothing to match
    cached = sum(box.prefix_cache.cached_tokens for box in fleet)
    prompt = sum(box.prefix_cache.prompt_tokens for box in fleet)
    assert cached >= 0.5 * prompt


def test_a_shared_system_prompt_alone_spreads_the_calls(start_fleet_in_process):
    router = start_fleet_in_process(*boxes(4))
    api = client(router)
    landed = []
    for n in range(24):  # one after another, each once the boxes' own reports show them idle again
        landed.append(chat(api, [SYSTEM, first_message(n)]))
        time.sleep(0.1)
    counts = {box: sum(1 for b, _ in landed if b == box) for box in "abcd"}
    assert all(affinity == "miss:prefix" for _, affinity in landed)
    assert min(counts.values()) >= 1 and max(counts.values()) <= 12, counts  # never all on one box


@pytest.mark.parametrize("interface", ["asgi", "rsgi"])  # each edge's own header look-up
def test_a_session_header_holds_across_a_rewritten_history(start_fleet_in_process, interface):
    router = start_fleet_in_process(*boxes(4), extra_args=("--interface", interface))
    api = client(router)
    sessions = {f"s{n}": chat(api, [first_message(n)], {"X-Router-Session": f"s{n}"})[0] for n in range(8)}
    assert len(set(sessions.values())) >= 2, how_they_landed(router, len(sessions))  # misses spread
    for session, box in sessions.items():
        rewritten = [{"role": "user", "content": f"a summary of everything in {session}"}]
        assert chat(api, rewritten, {"X-Router-Session": session}) == (box, "hit:session")
    # Codex CLI's header and prompt_cache_key are keys too
    box, affinity = chat(api, [first_message(1)], {"session_id": "codex-1"})
    assert affinity == "miss:session"
    assert chat(api, [first_message(2)], {"session_id": "codex-1"}) == (box, "hit:session")
    box, affinity = chat(api, [first_message(3)], prompt_cache_key="app-7")
    assert affinity == "miss:key"
    assert chat(api, [first_message(4)], prompt_cache_key="app-7") == (box, "hit:key")


def test_two_callers_with_the_same_session_id_are_not_bound_together(start_fleet_in_process):
    router = start_fleet_in_process(*boxes(4))
    first, second = client(router, "127.0.0.2"), client(router, "127.0.0.3")
    _, affinity = chat(first, [first_message(1)], {"X-Router-Session": "shared-id"})
    assert affinity == "miss:session"
    _, affinity = chat(first, [first_message(1)], {"X-Router-Session": "shared-id"})
    assert affinity == "hit:session"
    _, affinity = chat(second, [first_message(1)], {"X-Router-Session": "shared-id"})
    assert affinity == "miss:session"  # its own binding, made now, not the first caller's
    # nor by the same prompt: a prefix is scoped to its caller as well
    chat(first, [SYSTEM, first_message(9)])
    _, affinity = chat(second, [SYSTEM, first_message(9), {"role": "user", "content": "more"}])
    assert affinity == "miss:prefix"


def test_a_key_scopes_its_calls_only_once_the_gate_found_it_valid():
    """A key's id alone (a well-formed token with another secret) never joins its holder's scope:
    the scope is the gate's `key_id`, set only for a valid key, else the caller's address."""
    edge = SimpleNamespace(key_id=None, caller="10.0.0.7")
    assert scope_of(edge) == ("addr", "10.0.0.7")
    edge.key_id = "k1"
    assert scope_of(edge) == ("key", "k1")


def test_a_killed_boxs_conversations_move_once_and_stick_again(start_fleet_in_process):
    fleet = boxes(3)
    router = start_fleet_in_process(*fleet)
    api = client(router)
    histories = {n: [SYSTEM, first_message(n)] for n in range(9)}
    homes = {}
    for n, messages in histories.items():
        homes[n], _ = chat(api, messages)
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    victim = next(box for box in fleet if box.name in homes.values())
    router.fleet.stop_box(victim)
    moved = {}
    for turn in range(3):
        for n, messages in histories.items():
            box, affinity = chat(api, messages)
            messages += [{"role": "assistant", "content": f"ok {turn}"}, {"role": "user", "content": f"next {turn}"}]
            if homes[n] != victim.name:
                assert (box, affinity) == (homes[n], "hit:prefix")
            elif turn == 0:
                assert box != victim.name
                moved[n] = box
            else:
                assert (box, affinity) == (moved[n], "hit:prefix")  # the binding moved with it
    assert moved


def test_a_model_unloaded_drops_its_prefixes(start_fleet_in_process):
    fleet = boxes(2)
    router = start_fleet_in_process(*fleet)
    api = client(router)
    messages = [SYSTEM, first_message(1)]
    home, _ = chat(api, messages)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    assert chat(api, messages) == (home, "hit:prefix")
    box = next(b for b in fleet if b.name == home)
    resident_on = lambda: {m.id: m.model_extra["resident_on"] for m in api.models.list()}["tiny"]  # noqa: E731
    seat = box.residents.pop("tiny")
    box.changed()
    assert wait_for(lambda: home not in resident_on(), 5, 0.05)
    box.residents["tiny"] = seat  # loaded again: serving, with nothing of the conversation computed
    box.changed()
    assert wait_for(lambda: home in resident_on(), 5, 0.05)
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    _, affinity = chat(api, messages)
    assert affinity == "miss:prefix"


def test_affinity_off_is_the_seeds_order_and_says_nothing(start_fleet_in_process, tmp_path):
    router = start_fleet_in_process(*boxes(4), extra_args=("--affinity", "off"))
    api = client(router)
    landed = [chat(api, [SYSTEM, first_message(n)]) for n in range(6)]
    assert {affinity for _, affinity in landed} == {None}
    router.stop()
    store = next((tmp_path / "home").rglob("*.sqlite3"))
    with sqlite3.connect(store) as conn:
        assert {row[0] for row in conn.execute("SELECT affinity FROM route_log")} == {None}


def test_the_route_log_and_metrics_show_the_outcomes_and_cached_tokens(start_fleet_in_process, tmp_path):
    router = start_fleet_in_process(*boxes(2))
    converse(client(router), 1, 3)
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'router_affinity_hit_ratio{box="' in metrics
    assert wait_for(lambda: "router_engine_cached_tokens_total{" in httpx.get(router.url + "/metrics").text, 3)
    router.stop()
    store = next((tmp_path / "home").rglob("*.sqlite3"))
    with sqlite3.connect(store) as conn:
        rows = list(conn.execute("SELECT affinity, cached_tokens FROM route_log ORDER BY received_at"))
    assert [affinity for affinity, _ in rows] == ["miss:prefix", "hit:prefix", "hit:prefix"]
    assert rows[0][1] == 0 and rows[1][1] > 0 and rows[2][1] > rows[1][1]  # the engine's count, growing



def test_a_responses_chain_goes_back_to_the_box_that_holds_it(start_fleet_in_process):
    fleet = [SimLMStudio(name, models=["qwen"], loaded=["qwen"]) for name in "abcd"]
    router = start_fleet_in_process(*fleet)
    api = client(router)
    raw = api.responses.with_raw_response.create(model="qwen", input="Summarise this repository.")
    home, previous = raw.headers["x-hugpy-box"], raw.parse().id
    for turn in range(6):  # LM Studio keeps the conversation: only its box knows `previous`
        raw = api.responses.with_raw_response.create(model="qwen", input=f"and then {turn}?",
                                                      previous_response_id=previous, stream=turn % 2 == 1)
        parsed = raw.parse()
        if turn % 2:
            # read the stream to its end: a stream left open is closed by the collector, which can
            # run inside httpcore's pool lock on the next call and deadlock the client (seen in CI)
            events = list(parsed)
            previous = next(event.response.id for event in events if event.type == "response.completed")
        else:
            previous = parsed.id
        assert (raw.headers["x-hugpy-box"], raw.headers["x-router-affinity"]) == (home, "hit:response")
