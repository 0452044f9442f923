"""The Files and Batch API (router/serve/batch_api.py) through the official `openai` client on a
router in this process: the objects it answers, a bad file failing its batch with the lines at
fault, the 4xx of bad requests, and whose files and batches a caller sees. The fleet is empty:
no line runs unless a test gives it a box (running lines is tests/test_batch_runs.py's)."""

from __future__ import annotations

import io
import json

import openai
import pytest

from conftest import wait_for
from support.calls import bearer, new_key, request

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"


def lines(n: int, **body) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT,
                                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"q {i}"}],
                                         **body}}).encode() + b"\n" for i in range(n))


def client(router, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def upload(api: openai.OpenAI, data: bytes, name: str = "in.jsonl"):
    return api.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def admin_key(router) -> str:
    status, _, body = request(router, "POST", "/v1/keys", {"name": "ops", "scope": "admin"}, timeout=10)
    assert status == 201, body
    return json.loads(body)["key"]


@pytest.fixture
def router(start_fleet_in_process):
    return start_fleet_in_process()


def test_a_file_is_uploaded_listed_read_and_deleted(router):
    api = client(router, new_key(router)[1])
    data = lines(3)
    made = upload(api, data, "questions.jsonl")
    assert made.id.startswith("file-") and len(made.id) == len("file-") + 24
    assert (made.object, made.bytes, made.filename, made.purpose, made.status) == (
        "file", len(data), "questions.jsonl", "batch", "processed")
    assert isinstance(made.created_at, int)
    assert api.files.retrieve(made.id) == made
    assert api.files.content(made.id).content == data
    second = upload(api, b"{}\n", "other.jsonl")
    listed = api.files.list(purpose="batch")
    assert [f.id for f in listed.data] == [second.id, made.id] and not listed.has_more  # newest first
    page = api.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    assert [f.id for f in api.files.list(limit=1, after=second.id).data] == [made.id]
    assert api.files.list(purpose="batch_output").data == []
    deleted = api.files.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        api.files.content(made.id)


def test_a_batch_is_made_in_progress_read_listed_and_cancelled(router):
    api = client(router, new_key(router)[1])
    source = upload(api, lines(3))
    batch = api.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h",
                               metadata={"team": "search"})
    assert batch.id.startswith("batch_") and len(batch.id) == len("batch_") + 24
    assert (batch.object, batch.endpoint, batch.input_file_id, batch.completion_window, batch.status) == (
        "batch", CHAT, source.id, "24h", "in_progress")  # judged already: no box, so no line runs
    assert batch.errors is None and batch.metadata == {"team": "search"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 0, 0)
    assert batch.expires_at == batch.created_at + 86400 and batch.in_progress_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None and batch.cancelled_at is None
    assert batch.usage.total_tokens == 0
    assert api.batches.retrieve(batch.id) == batch
    later = api.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="90m")
    assert later.expires_at == later.created_at + 5400 and later.metadata is None
    listed = api.batches.list()
    assert [b.id for b in listed.data] == [later.id, batch.id] and not listed.has_more
    page = api.batches.list(limit=1)
    assert [b.id for b in page.data] == [later.id] and page.has_more
    assert [b.id for b in api.batches.list(limit=1, after=later.id).data] == [batch.id]
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    ended = wait_for(lambda: (b := api.batches.retrieve(batch.id)).status == "cancelled" and b, 10)
    assert ended, api.batches.retrieve(batch.id)
    # the files the router writes are read, never a batch's input
    output = api.files.retrieve(ended.output_file_id)
    assert output.purpose == "batch_output"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        api.batches.create(input_file_id=output.id, endpoint=CHAT, completion_window="24h")
    assert api.batches.cancel(batch.id).status == "cancelled"  # an ended batch is answered as it is


def test_a_bad_file_fails_its_batch_naming_each_bad_line(router):
    api = client(router)
    good = lines(1).rstrip(b"\n")
    data = b"\n".join([good.replace(b"line-0", b"a"), b"{not json", good.replace(b"line-0", b"a"),
                       good.replace(b'"POST"', b'"GET"').replace(b"line-0", b"b"), b"",
                       good.replace(b"line-0", b"c").replace(b'"model": "tiny"', b'"stream": true, "model": "tiny"')])
    batch = api.batches.create(input_file_id=upload(api, data).id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("invalid_method", 4), ("invalid_stream", 6)]
    assert batch.request_counts.total == 0
    assert api.batches.retrieve(batch.id).errors == batch.errors


def test_more_lines_than_the_cap_fail_the_batch(start_fleet_in_process):
    router = start_fleet_in_process(extra_args=("--batch-max-lines", "2"))
    api = client(router)
    assert api.batches.create(input_file_id=upload(api, lines(2)).id, endpoint=CHAT,
                              completion_window="24h").status == "in_progress"
    failed = api.batches.create(input_file_id=upload(api, lines(3)).id, endpoint=CHAT, completion_window="24h")
    assert failed.status == "failed" and [(e.code, e.line) for e in failed.errors.data] == [("too_many_tasks", 3)]


def test_a_file_over_the_cap_is_413(start_fleet_in_process):
    router = start_fleet_in_process(extra_args=("--batch-max-file-bytes", "1000"))
    api = client(router)
    assert upload(api, b"x" * 1000).bytes == 1000
    with pytest.raises(openai.APIStatusError) as refused:
        upload(api, b"x" * 1001)
    assert refused.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as refused:  # the form around it may not carry more either
        upload(api, b"x" * 200_000)
    assert refused.value.status_code == 413


def test_bad_requests_are_4xx_in_openais_shape(router):
    api = client(router)
    with pytest.raises(openai.BadRequestError) as refused:
        api.files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="fine-tune")
    assert refused.value.code == "invalid_purpose"
    source = upload(api, lines(1))
    cases = [
        (dict(endpoint="/v1/moderations"), "invalid_endpoint"),
        (dict(completion_window="25s"), "invalid_completion_window"),
        (dict(metadata={"k": 1}), "invalid_metadata"),
    ]
    for change, code in cases:
        asked = {"input_file_id": source.id, "endpoint": CHAT, "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as refused:
            api.batches.create(**asked)
        assert refused.value.code == code
    for call in (lambda: api.files.retrieve("file-" + "0" * 24), lambda: api.files.content("file-nope"),
                 lambda: api.files.delete("file-nope"), lambda: api.batches.retrieve("batch_" + "0" * 24),
                 lambda: api.batches.cancel("batch_nope"),
                 lambda: api.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    status, _, body = request(router, "POST", "/v1/files", headers={"Content-Type": "text/plain"})
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_form"
    status, _, body = request(router, "POST", "/v1/batches", {"input_file_id": source.id, "endpoint": CHAT},
                              headers={"Content-Type": "text/plain"})
    assert status == 415
    status, _, body = request(router, "GET", "/v1/batches?limit=101")
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_query"


def test_a_key_sees_only_its_own_and_an_admin_sees_every_owners(router):
    a, b = client(router, new_key(router)[1]), client(router, new_key(router)[1])
    a_file = upload(a, lines(2))
    a_batch = a.batches.create(input_file_id=a_file.id, endpoint=CHAT, completion_window="24h")
    b_file = upload(b, lines(1))
    for call in (lambda: b.files.retrieve(a_file.id), lambda: b.files.content(a_file.id),
                 lambda: b.files.delete(a_file.id), lambda: b.batches.retrieve(a_batch.id),
                 lambda: b.batches.cancel(a_batch.id),
                 lambda: b.batches.create(input_file_id=a_file.id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):  # never 403: what exists is not told
            call()
    assert [f.id for f in b.files.list().data] == [b_file.id]
    assert b.batches.list().data == []
    assert [f.id for f in a.files.list().data] == [a_file.id]
    for admin in (client(router, admin_key(router)), client(router)):  # an admin key; keyless on loopback
        assert {f.id for f in admin.files.list().data} == {a_file.id, b_file.id}
        assert admin.batches.retrieve(a_batch.id).id == a_batch.id
        assert admin.files.content(a_file.id).content == lines(2)
    status, _, _ = request(router, "GET", f"/v1/batches/{a_batch.id}", headers=bearer("hpk_nope_nope"))
    assert status == 401  # a use route: a bad key is refused before any of it
    assert a.batches.retrieve(a_batch.id).status == "in_progress"
