"""A call's record is written through its named facts only (router/serve/record.py), and its
row's state follows from how the call's lifecycle ended (router.core.lifecycle.row_state)."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest

from router.core.lifecycle import Event, Lifecycle, row_state
from router.core.limits import Tokens
from router.core.types import Call, Decision, Path
from router.facades.openai import FACADE
from router.serve.record import CallRecord

ROUTER = pathlib.Path(__file__).resolve().parent.parent / "router"


def record_writes(tree: ast.AST) -> list[str]:
    """`x.record.slot = ...`, `record.slot += ...`: a write to a record's slot from outside."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute):
                owner = target.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "record":
                    found.append(f"line {node.lineno}: record.{target.attr}")
    return found


def test_only_the_record_writes_its_slots():
    writes = {}
    for path in (ROUTER / "serve").glob("*.py"):
        if path.name != "record.py":
            found = record_writes(ast.parse(path.read_text()))
            if found:
                writes[path.name] = found
    assert writes == {}


def test_the_checker_sees_a_write():
    assert record_writes(ast.parse("self.reply.record.decision = d\nrecord.bytes_out += 1")) == [
        "line 1: record.decision", "line 2: record.bytes_out"]


@pytest.mark.parametrize(
    ("ended_by", "status", "failure", "turned_away", "state"),
    [
        (Event.DONE, 200, None, False, "done"),
        (Event.DONE, 400, "http_400", False, "failed"),  # the client's own error, as the box sent it
        (Event.DONE, 503, "no_box", True, "refused"),  # the router turned it away
        (Event.DONE, 429, "queue_full", True, "refused"),
        (Event.DONE, 0, None, False, "failed"),  # ended with no answer at all
        (Event.CLIENT_LEFT, 0, None, False, "cancelled"),
        (Event.CLIENT_LEFT, 200, None, False, "cancelled"),  # left mid-answer
        (Event.DEADLINE, 408, "body_timeout", False, "failed"),
        (Event.DEADLINE, 503, "queue_timeout", False, "failed"),
        (Event.BOX_FAILED, 200, None, False, "failed"),  # the box failed mid-answer
    ],
)
def test_the_state_follows_from_the_end(ended_by, status, failure, turned_away, state):
    assert row_state(ended_by, status, failure, turned_away) == state


def test_a_record_reads_its_state_and_failure_off_the_lifecycle():
    route, _ = FACADE.route("POST", "/v1/chat/completions")
    life = Lifecycle()
    record = CallRecord("c", FACADE, route, types.SimpleNamespace(caller="127.0.0.1", key_id=None, batch_id=None,
                                                                          custom_id=None), life)
    record.answered(200, stream=True)
    life.fire(Event.CLIENT_LEFT)
    assert (record.state, record.failure) == ("cancelled", "client_left")
    row = record.row()
    assert (row.state, row.error, row.http_status, row.stream) == ("cancelled", "client_left", 200, 1)


def test_each_column_of_the_row_holds_the_fact_it_names():
    """row() builds its Row by position (a keyword build costs a dict per call): a column out of
    place would show here."""
    route, _ = FACADE.route("POST", "/v1/chat/completions")
    life = Lifecycle()
    record = CallRecord("c-1", FACADE, route, types.SimpleNamespace(caller="10.0.0.9", key_id="k-1", header={}.get,
                                                                            batch_id="batch_1", custom_id="q-1"), life)
    record.body_read(11)
    record.asked(Call("m", frozenset(), settings="s", pin="b-1"))
    record.decided(Decision(Path.PINNED, ("b-1",), {}, {}))
    record.queued(7.5)
    box = types.SimpleNamespace(name="b-1")
    record.attempted("b-1", record.attempting(box), 200, None)  # type: ignore[arg-type]
    record.answered(201)
    record.sent(22)
    record.placed("hit:prefix")
    record.tokens = Tokens(3, 4, 5, True)
    life.fire(Event.DONE)
    row = record.row()._asdict()
    times = [row.pop(name) for name in ("received_at", "first_byte_at", "responded_at")]
    assert times == sorted(times) and all(isinstance(t, float) for t in times)
    assert row.pop("attempts") == record.attempts
    assert row.pop("decision") is record.decision
    assert row == {
        "request_id": "c-1", "state": "done", "facade": FACADE.name, "route": route.path, "model": "m",
        "options": "s", "pin": "b-1", "client": "10.0.0.9", "stream": 0, "path": Path.PINNED.value,
        "box": "b-1", "http_status": 201, "error": None, "bytes_in": 11, "bytes_out": 22, "waited_ms": 7.5,
        "key_id": "k-1", "prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 5, "tokens_estimated": 1,
        "affinity": "hit:prefix", "router": None, "batch_id": "batch_1", "custom_id": "q-1",
    }
