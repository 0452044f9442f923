"""OpenAI's Batch API, the rules without I/O: ids, the lines a batch writes, and what a line's
answer means for the line (docs/batches.md).

Rules:
1. Ids are OpenAI's shapes: `file-`, `batch_`, `batch_req_` and 24 hex digits (96 random bits).
2. A line's answer decides its fate (`fate`): a 2xx is its output; a refusal that says "later"
   (the key's rate or budget, no spare slot, the shared server down) puts it back to wait, never
   failing it; a failure of the fleet (no box answered, a box cut mid-answer: 5xx of the
   router's own) runs it again, at most MAX_LINE_ATTEMPTS times; any other answer (the box's 4xx,
   a model no box has) is final and goes to the error file with its response.
3. The lines written are OpenAI's: an answer keeps its response (`status_code`, `request_id`,
   `body`) with `error` null, in the output file (2xx) or the error file; a line that got no
   answer has `response` null and an `error` with its code (`unrun_line`).
4. A batch names one of ENDPOINTS and a window `<N>h` or `<N>m` from MIN_WINDOW_S to
   MAX_WINDOW_S (`window_seconds`; OpenAI takes only "24h"); its metadata is null or at most
   MAX_METADATA_PAIRS string pairs (keys up to 64 characters, values up to 512: OpenAI's).
5. An input file is judged whole before any line runs (`check_lines`): every line that is not
   blank is a JSON object with a `custom_id` (a non-empty string, unique in the file), `method`
   "POST", `url` the batch's endpoint and a `body` that is an object naming a string `model`
   and not asking to stream; a file with no line, or more than the lines cap, is refused. A
   file with any bad line runs no line: its errors (at most MAX_ERRORS_LISTED, 1-based line
   numbers) are the batch's.
6. The upload is a multipart/form-data body (RFC 7578), parsed whole (`form_parts`): a part is
   found by its delimiter alone (the boundary never occurs in a part: RFC 2046 5.1.1), its
   `Content-Disposition: form-data` names it (each name once) and may give a filename; anything
   else malformed is a BadRequest.
7. Files and batches are shown as OpenAI's objects (`file_object`, `batch_object`, `list_object`):
   times in whole seconds, a batch's `usage` in the Responses API's words.
"""

from __future__ import annotations

import enum
import json
import os
import re
from typing import Any

from router.core.errors import BadRequest

MAX_LINE_ATTEMPTS = 3
# Refusals that mean "not now" (rule 2): the line waits, and the code is kept so that a window
# ending while it waits can say why (a budget that ran out is `budget_exceeded`, not expired).
WAIT_CODES = frozenset({"rate_limited", "budget_exceeded", "no_spare_capacity", "queue_full",
                        "queue_share_full", "queue_timeout", "shared_store_down"})
# The fleet failed the line, not the line the fleet (rule 2): run it again.
RETRY_STATUSES = frozenset({500, 502, 503, 504})

# The routes a batch may name (rule 4): OpenAI's, but /v1/moderations, which no box serves.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
INSIDE = "inside"  # the one owner of every keyless caller's files and batches (docs/batches.md)
UPLOAD_PURPOSE = "batch"  # the one purpose a client uploads for
OUTPUT_PURPOSE = "batch_output"  # the files the router writes: read, never a batch's input
# A minute is the shortest wait worth a batch; a week, as the settings' longest duration
# (router.core.bounds.MAX_SECONDS).
MIN_WINDOW_S = 60
MAX_WINDOW_S = 7 * 86400
WINDOW_RE = re.compile(r"([1-9][0-9]{0,5})([hm])")
WINDOW_UNIT_S = {"h": 3600, "m": 60}
# OpenAI's metadata caps.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# OpenAI lists at most this many of a file's errors; the rest are the same mistakes again.
MAX_ERRORS_LISTED = 100
UTF8_BOM = b"\xef\xbb\xbf"
# A part's headers are a line or three (RFC 7578 4.8): more is not a form.
MAX_PART_HEAD_BYTES = 16 * 1024
# RFC 2046 5.1.1: a boundary is 1 to 70 characters.
MAX_BOUNDARY_CHARS = 70
# A header's parameters: `; name=token` or `; name="quoted \"string\""` (RFC 9110 5.6.6).
PARAM_RE = re.compile(r""";[ \t]*([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*=[ \t]*("(?:[^"\\]|\\.)*"|[^;"\s]*)[ \t]*""")
QUOTED_PAIR_RE = re.compile(r"\\(.)")


class Fate(enum.Enum):
    OUTPUT = "output"  # a 2xx: the output file
    ERROR = "error"  # final, not 2xx: the error file, with its response
    WAIT = "wait"  # put back until later; not an attempt
    RETRY = "retry"  # put back and run again, an attempt spent


# What became of a line a router ran, by its fate (router_batch_lines_total's `state`), and of the
# unrun lines a batch's end settled: every state a line is counted in.
STATE_OF_FATE = {Fate.OUTPUT: "completed", Fate.ERROR: "failed", Fate.RETRY: "retried", Fate.WAIT: "waited"}
LINE_STATES = (*STATE_OF_FATE.values(), "expired", "cancelled")


def new_id(prefix: str) -> str:
    """`file-…`, `batch_…`, `batch_req_…` (rule 1)."""
    return prefix + os.urandom(12).hex()


def fate(status: int, code: str | None, attempts: int) -> Fate:
    """What the answer `status` (with the router's error `code`, if any) means for a line that has
    had `attempts` attempts before this one (rule 2)."""
    if 200 <= status < 300:
        return Fate.OUTPUT
    if code in WAIT_CODES:
        return Fate.WAIT
    if status in RETRY_STATUSES and attempts + 1 < MAX_LINE_ATTEMPTS:
        return Fate.RETRY
    return Fate.ERROR


def answer_line(custom_id: str, status: int, request_id: str, body: bytes) -> bytes:
    """The output or error file's line for an answer (rule 3): its body as JSON when it is JSON,
    else as text."""
    try:
        answer = json.loads(body) if body else None
    except ValueError:
        answer = body.decode("utf-8", "replace")
    return _line(custom_id, {"status_code": status, "request_id": request_id, "body": answer}, None)


def unrun_line(custom_id: str, code: str, message: str) -> bytes:
    """The error file's line for a line that got no answer (rule 3)."""
    return _line(custom_id, None, {"code": code, "message": message})


def _line(custom_id: str, response: dict | None, error: dict | None) -> bytes:
    doc = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def window_seconds(text: object) -> int:
    """The seconds of a completion window `<N>h` or `<N>m` (rule 4). Raises BadRequest
    (`invalid_completion_window`) for anything else, or a window outside MIN_WINDOW_S to
    MAX_WINDOW_S."""
    found = WINDOW_RE.fullmatch(text) if isinstance(text, str) else None
    seconds = int(found.group(1)) * WINDOW_UNIT_S[found.group(2)] if found else 0
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise BadRequest(f"completion_window must be like 24h or 90m, from {MIN_WINDOW_S // 60}m to "
                         f"{MAX_WINDOW_S // 3600}h", code="invalid_completion_window")
    return seconds


def check_endpoint(endpoint: object) -> str:
    """`endpoint` when a batch may name it (rule 4). Raises BadRequest (`invalid_endpoint`)."""
    if endpoint not in ENDPOINTS:
        raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", code="invalid_endpoint")
    return endpoint  # type: ignore[return-value]


def check_metadata(metadata: object) -> dict[str, str] | None:
    """`metadata` when it is null or OpenAI's string pairs (rule 4). Raises BadRequest
    (`invalid_metadata`)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs",
                         code="invalid_metadata")
    for key, value in metadata.items():
        if not (isinstance(value, str) and len(key) <= MAX_METADATA_KEY_CHARS
                and len(value) <= MAX_METADATA_VALUE_CHARS):
            raise BadRequest(f"metadata values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters, "
                             f"keys at most {MAX_METADATA_KEY_CHARS}", code="invalid_metadata")
    return metadata


def check_lines(data: bytes, endpoint: str, max_lines: int,
                max_line_bytes: int | None = None) -> tuple[list[tuple[int, str, bytes]], list[dict]]:
    """An input file judged whole (rule 5). Returns (lines, errors): each line that is not blank
    as (line number, custom_id, its body as JSON), and OpenAI's errors (`code`, `message`,
    `param`, `line`), at most MAX_ERRORS_LISTED; a file with any error has no lines to run
    (lines is then empty). A line over `max_line_bytes` (a call's largest body) is not parsed:
    it could never run, and its parse would hold the interpreter for seconds. Never raises for
    what the file holds."""
    lines: list[tuple[int, str, bytes]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    count = 0
    for line_no, raw in enumerate(data.removeprefix(UTF8_BOM).split(b"\n"), 1):
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            del errors[MAX_ERRORS_LISTED - 1:]
            errors.append(_error("too_many_tasks", f"the file has more than {max_lines} lines (--batch-max-lines)",
                                 None, line_no))
            break
        if len(errors) == MAX_ERRORS_LISTED:
            continue  # enough listed; counted still, since too many lines is the error to know
        if max_line_bytes is not None and len(raw) > max_line_bytes:
            errors.append(_error("line_too_large", f"the line is over {max_line_bytes} bytes (--max-body)", None,
                                 line_no))
            continue
        try:
            custom_id, body = _check_line(raw, endpoint, seen)
        except BadLine as bad:
            errors.append(_error(bad.code, str(bad), bad.param, line_no))
            continue
        if not errors:
            lines.append((line_no, custom_id, body))
    if count == 0:
        errors.append(_error("empty_file", "the file has no line", None, None))
    return ([] if errors else lines), errors


def _error(code: str, message: str, param: str | None, line: int | None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


class BadLine(ValueError):
    """A line of an input file that cannot run (rule 5): OpenAI's error `code` for it and the
    field at fault (`param`, None for the line as a whole)."""

    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_line(raw: bytes, endpoint: str, seen: set[str]) -> tuple[str, bytes]:
    """(custom_id, body as JSON) of one line that is not blank (rule 5); `seen` gets its
    custom_id. Raises BadLine."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested past the parser's stack
        raise BadLine("invalid_json_line", "this line is not valid JSON (UTF-8, one object a line)", None) from None
    if not isinstance(doc, dict):
        raise BadLine("invalid_json_line", "a line must be a JSON object", None)
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or not _is_unicode(custom_id) or "\x00" in custom_id:
        # (a NUL: PostgreSQL's text holds none, and no id needs one)
        raise BadLine("invalid_custom_id", "custom_id must be a non-empty string without NUL", "custom_id")
    if custom_id in seen:
        raise BadLine("duplicate_custom_id", "this custom_id is on an earlier line; each must be unique", "custom_id")
    seen.add(custom_id)
    if doc.get("method") != "POST":
        raise BadLine("invalid_method", 'method must be "POST"', "method")
    if doc.get("url") != endpoint:
        raise BadLine("invalid_url", f"url must be the batch's endpoint, {endpoint}", "url")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise BadLine("invalid_body", "body must be a JSON object", "body")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadLine("missing_model", "body must name a model (a string)", "body.model")
    if body.get("stream") is True:
        raise BadLine("invalid_stream", "a batch line cannot stream", "body.stream")
    # ASCII escapes: a lone surrogate from a `\ud800` escape cannot be written as UTF-8
    return custom_id, json.dumps(body, separators=(",", ":")).encode()


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (a `\\ud800` escape), which no file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def form_parts(body: bytes, content_type: str | None) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data `body` (rule 6): name -> (filename or None, content).
    Raises BadRequest (`invalid_form`) for a content type that is not a form with a boundary, a
    body without its delimiters, a part without a form-data name, a name given twice."""
    boundary = _boundary(content_type)
    delimiter = b"\r\n--" + boundary
    if body.startswith(delimiter[2:]):
        at = len(delimiter) - 2
    else:  # a preamble, ignored
        found = body.find(delimiter)
        if found < 0:
            raise _form_error("the body has no part")
        at = found + len(delimiter)
    parts: dict[str, tuple[str | None, bytes]] = {}
    while not body.startswith(b"--", at):  # `--` after a delimiter closes the form; an epilogue is ignored
        line_end = body.find(b"\r\n", at)
        if line_end < 0 or body[at:line_end].strip(b" \t"):  # transport padding, then CRLF
            raise _form_error("a delimiter is not followed by a line end")
        head_start = line_end + 2
        if body.startswith(b"\r\n", head_start):
            head, content_start = b"", head_start + 2
        else:
            head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_PART_HEAD_BYTES + 4)
            if head_end < 0:
                raise _form_error("a part's headers do not end")
            head, content_start = body[head_start:head_end], head_end + 4
        content_end = body.find(delimiter, content_start)
        if content_end < 0:
            raise _form_error("the form does not end with its closing delimiter")
        name, filename = _disposition(head)
        if name in parts:
            raise _form_error(f"the form has two parts named {name!r}")
        parts[name] = (filename, body[content_start:content_end])
        at = content_end + len(delimiter)
    return parts


def _form_error(message: str) -> BadRequest:
    return BadRequest(f"not a multipart/form-data body: {message}", code="invalid_form")


def _boundary(content_type: str | None) -> bytes:
    media, params = _header_params(content_type or "")
    boundary = params.get("boundary", "")
    if media.lower() != "multipart/form-data" or not 1 <= len(boundary) <= MAX_BOUNDARY_CHARS:
        raise BadRequest("the upload must be multipart/form-data with a boundary (a `file` part and a "
                         "`purpose` field)", code="invalid_form")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        raise _form_error("the boundary is not ASCII") from None


def _disposition(head: bytes) -> tuple[str, str | None]:
    """(name, filename or None) of a part from its headers' Content-Disposition."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        raise _form_error("a part's headers are not UTF-8") from None
    for line in text.split("\r\n"):
        field, colon, value = line.partition(":")
        if not colon:
            raise _form_error("a part's header line has no colon")
        if field.strip().lower() == "content-disposition":
            kind, params = _header_params(value)
            if kind.lower() != "form-data" or not params.get("name"):
                raise _form_error("a part's Content-Disposition is not form-data with a name")
            return params["name"], params.get("filename")
    raise _form_error("a part has no Content-Disposition")


def _header_params(value: str) -> tuple[str, dict[str, str]]:
    """A header value `kind; a=b; c="d"` as (kind, {a: b, c: d}); parameter names lowered."""
    kind = value.partition(";")[0]
    at = len(kind)
    params: dict[str, str] = {}
    while value[at:].strip("; \t"):  # (a trailing `;` is no parameter)
        found = PARAM_RE.match(value, at)
        if found is None:
            raise _form_error("a header's parameters do not parse")
        name, text = found.group(1).lower(), found.group(2)
        params[name] = QUOTED_PAIR_RE.sub(r"\1", text[1:-1]) if text.startswith('"') else text
        at = found.end()
    return kind.strip(), params


def file_object(row: Any) -> dict:
    """OpenAI's file object for a stored file (router.store.batches FileRow) (rule 7)."""
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": int(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: Any) -> dict:
    """OpenAI's batch object for a stored batch (router.store.batches BatchRow) (rule 7): its
    `errors` and `metadata` columns are JSON text (errors a list of check_lines' errors)."""
    errors = json.loads(row.errors) if row.errors else None
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint,
        "errors": None if errors is None else {"object": "list", "data": errors},
        "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id, "error_file_id": row.error_file_id,
        "created_at": int(row.created_at), "in_progress_at": _seconds(row.in_progress_at),
        "expires_at": _seconds(row.expires_at), "finalizing_at": _seconds(row.finalizing_at),
        "completed_at": _seconds(row.completed_at), "failed_at": _seconds(row.failed_at),
        "expired_at": _seconds(row.expired_at), "cancelling_at": _seconds(row.cancelling_at),
        "cancelled_at": _seconds(row.cancelled_at),
        "request_counts": {"total": row.total or 0, "completed": row.completed or 0, "failed": row.failed or 0},
        "metadata": json.loads(row.metadata) if row.metadata else None,
        "usage": {"input_tokens": row.prompt_tokens or 0, "output_tokens": row.completion_tokens or 0,
                  "total_tokens": (row.prompt_tokens or 0) + (row.completion_tokens or 0),
                  "input_tokens_details": {"cached_tokens": row.cached_tokens or 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def list_object(objects: list[dict], has_more: bool) -> dict:
    """OpenAI's list of files or batches, one page (rule 7)."""
    return {"object": "list", "data": objects, "has_more": has_more,
            "first_id": objects[0]["id"] if objects else None, "last_id": objects[-1]["id"] if objects else None}


def _seconds(at: float | None) -> int | None:
    return None if at is None else int(at)
