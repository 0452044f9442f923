"""The Batch API's pure rules (router/core/batches.py): the window and metadata (rule 4), the
input file judged whole line by line (rule 5), the upload's multipart/form-data parser against
forms encoded here and by httpx (rule 6), and the OpenAI objects (rule 7)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core import batches
from router.core.batches import (
    ENDPOINTS,
    MAX_ERRORS_LISTED,
    batch_object,
    check_endpoint,
    check_lines,
    check_metadata,
    file_object,
    form_parts,
    list_object,
    window_seconds,
)
from router.core.errors import BadRequest

CHAT = "/v1/chat/completions"


def line(custom_id="a", method="POST", url=CHAT, body=None, **extra) -> bytes:
    doc = {"custom_id": custom_id, "method": method, "url": url,
           "body": {"model": "tiny", "messages": []} if body is None else body, **extra}
    return json.dumps(doc).encode()


def errors_of(data: bytes, endpoint: str = CHAT, max_lines: int = 100) -> list[tuple[str, int | None]]:
    lines, errors = check_lines(data, endpoint, max_lines)
    assert not (lines and errors)
    return [(error["code"], error["line"]) for error in errors]


# --------------------------------------------------------------------------------------------
# Rule 4: endpoint, window, metadata
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "seconds"), [("24h", 86400), ("1m", 60), ("90m", 5400), ("168h", 7 * 86400),
                                               ("10080m", 7 * 86400)])
def test_a_window_is_hours_or_minutes_from_a_minute_to_a_week(text, seconds):
    assert window_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "24s", "0h", "0m", "169h", "10081m", "1.5h", " 24h", "24H", "-1h",
                                  "024h", "1d", 24, None, ["24h"]])
def test_any_other_window_is_refused(text):
    with pytest.raises(BadRequest) as refused:
        window_seconds(text)
    assert refused.value.code == "invalid_completion_window"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_endpoints_a_batch_may_name(endpoint):
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["/v1/moderations", "/v1/chat/completions/", "v1/embeddings", "", None, 1])
def test_another_endpoint_is_refused(endpoint):
    with pytest.raises(BadRequest) as refused:
        check_endpoint(endpoint)
    assert refused.value.code == "invalid_endpoint"


@pytest.mark.parametrize("metadata", [None, {}, {"team": "a"}, {f"k{i}": "v" * 512 for i in range(16)},
                                      {"k" * 64: ""}])
def test_metadata_is_null_or_up_to_16_string_pairs(metadata):
    assert check_metadata(metadata) == metadata


@pytest.mark.parametrize("metadata", [[], "x", 1, {f"k{i}": "v" for i in range(17)}, {"k": 1}, {"k": None},
                                      {"k": "v" * 513}, {"k" * 65: "v"}])
def test_other_metadata_is_refused(metadata):
    with pytest.raises(BadRequest) as refused:
        check_metadata(metadata)
    assert refused.value.code == "invalid_metadata"


# --------------------------------------------------------------------------------------------
# Rule 5: the input file
# --------------------------------------------------------------------------------------------
def test_a_good_file_gives_its_lines_with_their_line_numbers_and_bodies():
    data = b"\n".join([line("a"), b"", b"  \r", line("b", body={"model": "m", "stream": False}), b""])
    lines, errors = check_lines(data, CHAT, 10)
    assert errors == []
    assert [(no, cid) for no, cid, _ in lines] == [(1, "a"), (4, "b")]  # blank lines are counted, not run
    assert json.loads(lines[1][2]) == {"model": "m", "stream": False}


def test_crlf_lines_and_a_byte_order_mark_are_read():
    lines, errors = check_lines(batches.UTF8_BOM + line("a") + b"\r\n" + line("b") + b"\r\n", CHAT, 10)
    assert errors == [] and [cid for _, cid, _ in lines] == ["a", "b"]


@pytest.mark.parametrize(("bad", "code"), [
    (b"{not json", "invalid_json_line"),
    (b"\xff\xfe{}", "invalid_json_line"),  # not UTF-8
    (b'{"custom_id": "x", "body": {"model": NaN}}', "invalid_json_line"),  # NaN is no JSON
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json_line"),  # deeper than the parser goes
    (b"[1, 2]", "invalid_json_line"),  # not an object
    (b'"a line"', "invalid_json_line"),
    (line(custom_id=None), "invalid_custom_id"),
    (line(custom_id=""), "invalid_custom_id"),
    (line(custom_id=7), "invalid_custom_id"),
    (line(custom_id="a\x00b"), "invalid_custom_id"),  # PostgreSQL's text holds no NUL
    (b'{"custom_id": "\\ud800", "method": "POST"}', "invalid_custom_id"),  # a lone surrogate
    (line(method="GET"), "invalid_method"),
    (line(method=None), "invalid_method"),
    (line(url="/v1/embeddings"), "invalid_url"),
    (line(url=None), "invalid_url"),
    (line(body=[]), "invalid_body"),
    (line(body="text"), "invalid_body"),
    (line(body={"messages": []}), "missing_model"),
    (line(body={"model": ""}), "missing_model"),
    (line(body={"model": 3}), "missing_model"),
    (line(body={"model": "m", "stream": True}), "invalid_stream"),
])
def test_each_bad_line_fails_the_file_naming_its_line(bad, code):
    data = b"\n".join([line("first"), bad, line("last")])
    lines, errors = check_lines(data, CHAT, 10)
    assert lines == []  # a file with a bad line runs no line
    assert [(e["code"], e["line"]) for e in errors] == [(code, 2)]
    assert errors[0]["message"] and set(errors[0]) == {"code", "message", "param", "line"}


def test_a_line_without_a_custom_id_is_refused():
    assert errors_of(json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}).encode()) == [
        ("invalid_custom_id", 1)]


def test_a_duplicate_custom_id_is_refused_on_the_later_line():
    assert errors_of(b"\n".join([line("a"), line("b"), line("a")])) == [("duplicate_custom_id", 3)]


def test_a_stream_line_is_refused_in_those_words():
    _, errors = check_lines(line(body={"model": "m", "stream": True}), CHAT, 10)
    assert errors[0]["message"] == "a batch line cannot stream" and errors[0]["param"] == "body.stream"


def test_the_url_must_be_the_batchs_endpoint_whichever_it_is():
    embed = line(url="/v1/embeddings", body={"model": "e", "input": "x"})
    assert errors_of(embed, endpoint="/v1/embeddings") == []
    assert errors_of(embed, endpoint=CHAT) == [("invalid_url", 1)]


def test_more_lines_than_the_cap_fail_the_file_at_the_first_line_over_it():
    data = b"\n".join(line(str(i)) for i in range(5))
    assert errors_of(data, max_lines=5) == []
    assert errors_of(data, max_lines=4) == [("too_many_tasks", 5)]
    assert errors_of(b"\n\n" + data, max_lines=3) == [("too_many_tasks", 6)]  # blank lines are not lines


def test_an_empty_file_is_refused():
    assert errors_of(b"") == [("empty_file", None)]
    assert errors_of(b"\n \n\r\n") == [("empty_file", None)]


def test_a_line_over_the_call_body_limit_is_refused_unparsed():
    big = line("big", body={"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
    data = line("small") + b"\n" + big
    assert check_lines(data, CHAT, 100, max_line_bytes=len(big))[1] == []
    lines, errors = check_lines(data, CHAT, 100, max_line_bytes=len(big) - 1)
    assert lines == [] and [(e["code"], e["line"]) for e in errors] == [("line_too_large", 2)]


def test_at_most_100_errors_are_listed_and_too_many_lines_is_one_of_them():
    bad = b"\n".join([b"x"] * 300)
    listed = errors_of(bad, max_lines=1000)
    assert listed == [("invalid_json_line", n) for n in range(1, MAX_ERRORS_LISTED + 1)]
    listed = errors_of(bad, max_lines=150)  # counted on past the errors listed
    assert len(listed) == MAX_ERRORS_LISTED and listed[-1] == ("too_many_tasks", 151)
    assert listed[:-1] == [("invalid_json_line", n) for n in range(1, MAX_ERRORS_LISTED)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=8), st.booleans()),
                min_size=1, max_size=20))
def test_a_file_runs_every_line_or_none(spec):
    """Lines built good or bad: the file runs every good line in order exactly when none is bad;
    every bad one is named (distinct custom_ids keep each good line good)."""
    rows = [line(f"{i}-{cid}") if good else line(f"{i}-{cid}", method="PUT") for i, (cid, good) in enumerate(spec)]
    lines, errors = check_lines(b"\n".join(rows), CHAT, 100)
    bad_lines = [n for n, (_, good) in enumerate(spec, 1) if not good]
    assert [e["line"] for e in errors] == bad_lines
    assert [no for no, _, _ in lines] == ([] if bad_lines else list(range(1, len(spec) + 1)))


# --------------------------------------------------------------------------------------------
# Rule 6: multipart/form-data
# --------------------------------------------------------------------------------------------
def encode(parts: list[tuple[str, str | None, bytes]], boundary: str, preamble: bytes = b"",
           epilogue: bytes = b"") -> bytes:
    """A form as RFC 7578 writes it, with an optional preamble and epilogue (RFC 2046 5.1.1)."""
    out = [preamble + (b"\r\n" if preamble else b"")]
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode())
        if filename is not None:
            out.append(b"Content-Type: application/octet-stream\r\n")
        out.append(b"\r\n" + content + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode() + epilogue)
    return b"".join(out)


NAMES = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters='"\\'), min_size=1,
                max_size=12)
BOUNDARIES = st.text(st.sampled_from("abcXYZ0123456789'()+_,-./:=?"), min_size=1, max_size=70)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(NAMES, st.tuples(st.none() | NAMES, st.binary(max_size=200)), max_size=5), BOUNDARIES,
       st.binary(max_size=20).filter(lambda b: b"--" not in b), st.binary(max_size=20))
def test_a_form_reads_back_as_its_parts(parts, boundary, preamble, epilogue):
    delimiter = b"\r\n--" + boundary.encode()
    body = encode([(name, filename, content) for name, (filename, content) in parts.items()], boundary,
                  preamble, epilogue)
    if any(delimiter in b"\r\n" + content + b"\r\n" for _, content in parts.values()):
        return  # the sender picks a boundary its contents do not hold (RFC 2046 5.1.1)
    assert form_parts(body, f'multipart/form-data; boundary="{boundary}"') == parts


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2000), NAMES, st.sampled_from(["batch", "fine-tune", ""]))
def test_httpxs_form_reads_back(content, filename, purpose):
    """The form the openai client sends (httpx's encoder): another writer than this suite's."""
    sent = httpx.Request("POST", "http://router/v1/files", files={"file": (filename, content)},
                         data={"purpose": purpose})
    parts = form_parts(sent.read(), sent.headers["content-type"])
    assert parts["file"][1] == content and parts["purpose"] == (None, purpose.encode())


def test_the_closing_delimiter_may_come_without_a_line_end_and_a_part_without_headers_is_refused():
    unended = b'--b\r\nContent-Disposition: form-data; name="a"\r\n\r\nx\r\n--b--'
    assert form_parts(unended, "multipart/form-data; boundary=b") == {"a": (None, b"x")}
    with pytest.raises(BadRequest):
        form_parts(b"--b\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b")


@pytest.mark.parametrize(("body", "content_type"), [
    (b"", "multipart/form-data; boundary=b"),  # no part
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx", "multipart/form-data; boundary=b"),  # unclosed
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n", "multipart/form-data; boundary=b"),  # head unended
    (b"--bx\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: form-data; filename=\"f\"\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nno colon here\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: form-data; name=\"\xff\"\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"),
    (b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n--b\r\n"
     b"Content-Disposition: form-data; name=\"a\"\r\n\r\ny\r\n--b--", "multipart/form-data; boundary=b"),  # twice
    (b"--b\r\n" + b"X: " + b"y" * (batches.MAX_PART_HEAD_BYTES + 10) + b"\r\n\r\nx\r\n--b--",
     "multipart/form-data; boundary=b"),
    (b"--b x\r\n", "multipart/form-data; boundary=b"),  # a delimiter followed by anything but padding
    (b"x", "application/json"),
    (b"x", None),
    (b"x", "multipart/form-data"),  # no boundary
    (b"x", "multipart/form-data; boundary="),
    (b"x", "multipart/form-data; boundary=" + "b" * 71),
    (b"x", "multipart/form-data; boundary=\"b"),  # an unclosed quote
    (b"x", "multipart/form-data; boundary=é"),
])
def test_a_malformed_form_is_a_bad_request(body, content_type):
    with pytest.raises(BadRequest) as refused:
        form_parts(body, content_type)
    assert refused.value.code == "invalid_form"


def test_the_form_header_parameters_take_quoted_pairs_any_case_and_a_trailing_semicolon():
    body = b'--b\r\ncontent-disposition: Form-Data; NAME="f"; filename="a \\"b\\".jsonl";\r\n\r\nx\r\n--b--\r\n'
    assert form_parts(body, "Multipart/Form-Data; charset=utf-8; BOUNDARY=b;") == {"f": ('a "b".jsonl', b"x")}


# --------------------------------------------------------------------------------------------
# Rule 7: the objects
# --------------------------------------------------------------------------------------------
def test_a_file_object_is_openais():
    row = SimpleNamespace(id="file-" + "0" * 24, owner="k1", purpose="batch", filename="in.jsonl", bytes=12,
                          created_at=1700000000.7)
    assert file_object(row) == {"id": row.id, "object": "file", "bytes": 12, "created_at": 1700000000,
                                "filename": "in.jsonl", "purpose": "batch", "status": "processed",
                                "expires_at": None, "status_details": None}


BATCH_ROW = dict(id="batch_" + "1" * 24, owner="k1", endpoint=CHAT, input_file_id="file-x", completion_window="24h",
                 status="in_progress", created_at=100.9, expires_at=86500.9, in_progress_at=101.2, finalizing_at=None,
                 completed_at=None, failed_at=None, expired_at=None, cancelling_at=None, cancelled_at=None, total=3,
                 completed=1, failed=1, prompt_tokens=10, completion_tokens=5, cached_tokens=2, output_file_id=None,
                 error_file_id=None, errors=None, metadata='{"team":"a"}')


def test_a_batch_object_is_openais():
    doc = batch_object(SimpleNamespace(**BATCH_ROW))
    assert doc == {
        "id": BATCH_ROW["id"], "object": "batch", "endpoint": CHAT, "errors": None, "input_file_id": "file-x",
        "completion_window": "24h", "status": "in_progress", "output_file_id": None, "error_file_id": None,
        "created_at": 100, "in_progress_at": 101, "expires_at": 86500, "finalizing_at": None, "completed_at": None,
        "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 3, "completed": 1, "failed": 1}, "metadata": {"team": "a"},
        "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                  "input_tokens_details": {"cached_tokens": 2}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def test_a_failed_batch_lists_its_files_errors():
    _, errors = check_lines(b"x\n" + line(method="GET"), CHAT, 10)
    row = SimpleNamespace(**{**BATCH_ROW, "status": "failed", "failed_at": 102.0, "errors": json.dumps(errors),
                             "metadata": None})
    doc = batch_object(row)
    assert doc["errors"] == {"object": "list", "data": errors} and doc["metadata"] is None
    assert [e["line"] for e in doc["errors"]["data"]] == [1, 2] and doc["failed_at"] == 102


def test_a_list_names_its_first_and_last_ids():
    assert list_object([{"id": "a"}, {"id": "b"}], True) == {"object": "list", "data": [{"id": "a"}, {"id": "b"}],
                                                             "has_more": True, "first_id": "a", "last_id": "b"}
    assert list_object([], False) == {"object": "list", "data": [], "has_more": False, "first_id": None,
                                      "last_id": None}
