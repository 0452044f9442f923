"""`router batches list|show|cancel` (router/cli/batches.py): `python -m router` on a real store
under HUGPY_ROUTER_HOME=tmp_path, its batches put there by router.store.batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import orjson
import pytest

from router.store.batches import BatchStore

CHAT = "/v1/chat/completions"
CREATED_AT = 1_700_000_000.0  # 2023-11-14T22:13:20Z


def body(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "CANARY-line"}]})


@pytest.fixture
def store(tmp_path):
    """The store the command reads: HUGPY_ROUTER_HOME=tmp_path's router.sqlite3."""
    opened = BatchStore(tmp_path / "router.sqlite3")
    yield opened
    opened.close()


@pytest.fixture
def run(tmp_path):
    env = {**os.environ, "HUGPY_ROUTER_HOME": str(tmp_path)}
    env.pop("HUGPY_ROUTER_DATABASE_URL", None)

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "router", "batches", *argv], capture_output=True, text=True,
                              timeout=60, env=env)

    return run


def running_batch(store: BatchStore, owner: str, lines: int, now: float = CREATED_AT):
    """An in_progress batch of `owner` with `lines` lines, none run."""
    upload = store.put_file(owner, "batch", "in.jsonl", b"{}", now)
    batch = store.create(owner, CHAT, upload.id, "24h", 86400, '{"team": "a"}', now)
    return store.validated(batch.id, [(n, f"req-{n}", body("tiny")) for n in range(1, lines + 1)], None, now)


def test_list_shows_every_owners_batches_newest_first_with_their_counts(store, run):
    older = running_batch(store, "k1", 3)
    newer = running_batch(store, "inside", 2, CREATED_AT + 60)
    store.cancel(newer.id, CREATED_AT + 61)
    result = run("list")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header == "id\towner\tstatus\tendpoint\tcompleted/failed/total\tcreated"
    assert rows == [
        f"{newer.id}\tinside\tcancelling\t{CHAT}\t0/0/2\t2023-11-14T22:14:20Z",
        f"{older.id}\tk1\tin_progress\t{CHAT}\t0/0/3\t2023-11-14T22:13:20Z",
    ]
    assert [line.split("\t")[0] for line in run("list", "--owner", "k1").stdout.splitlines()[1:]] == [older.id]
    limited = run("list", "--limit", "1")
    assert len(limited.stdout.splitlines()) == 2 and "--limit" in limited.stderr
    doc = json.loads(run("list", "--json").stdout)
    assert doc["object"] == "list" and [b["id"] for b in doc["data"]] == [newer.id, older.id]
    assert doc["data"][1]["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert doc["has_more"] is False and doc["first_id"] == newer.id and doc["last_id"] == older.id
    assert "CANARY" not in result.stdout + doc.__repr__()


def test_show_prints_the_batch_object_and_an_unknown_id_exits_1(store, run):
    batch = running_batch(store, "k1", 2)
    result = run("show", batch.id)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["id"], shown["object"], shown["status"], shown["endpoint"]) == (batch.id, "batch", "in_progress", CHAT)
    assert shown["created_at"] == int(CREATED_AT) and shown["metadata"] == {"team": "a"}
    assert shown["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert "CANARY" not in result.stdout
    missing = run("show", "batch_000000000000000000000000")
    assert missing.returncode == 1 and "no batch with id batch_000000000000000000000000" in missing.stderr


def test_cancel_marks_a_running_batch_cancelling_and_leaves_an_ended_one(store, run, tmp_path):
    batch = running_batch(store, "k1", 2)
    result = run("cancel", batch.id)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"batch {batch.id} cancelling")
    row = store.batch(batch.id)
    assert row.status == "cancelling" and row.cancelling_at is not None
    assert [b.id for b in store.live()] == [batch.id]  # a running router's runner ends it from here
    assert store.end_unrun(batch.id, {}, "batch_cancelled", "cancelled", CREATED_AT + 5) == 2
    assert store.finalize(batch.id, "cancelled", CREATED_AT + 5).status == "cancelled"
    again = run("cancel", batch.id)
    assert again.returncode == 1 and f"batch {batch.id} is cancelled" in again.stderr
    assert store.batch(batch.id).status == "cancelled"
    missing = run("cancel", "batch_000000000000000000000000")
    assert missing.returncode == 1 and "no batch with id" in missing.stderr


def test_the_postgresql_store_is_read_and_changed_with_database_url(pg_url, run, tmp_path):
    from router.store import engines

    engines.open_database(pg_url)
    shared = engines.batches(tmp_path / "router.sqlite3", pg_url)
    try:
        batch = running_batch(shared, "k1", 2)
        listed = run("--database-url", pg_url, "list")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.splitlines()[1].startswith(f"{batch.id}\tk1\tin_progress\t")
        assert run("list").stdout.splitlines()[1:] == []  # the store file is another store
        assert run("--database-url", pg_url, "cancel", batch.id).returncode == 0
        assert shared.batch(batch.id).status == "cancelling"
    finally:
        shared.close()
