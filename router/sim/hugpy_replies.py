"""What the simulated hugpy box writes and reads on the wire (contracts/hugpy-wrapper.md §1, §4,
§6, §8): its canned bodies, its error shape, its stream frames, its replies per task route,
and how a task route's fields are read.

Rules:
1. JSON is written with the stdlib encoder (`ensure_ascii=False`, default separators), as the
   box writes it, so byte scanners in the router meet the real spacing (`"a": 1`).
2. Errors are `{"error": {"message", "type"?, "code"?}}` (§4.1): `type` and `code` are each
   left out when None (the box has untyped errors and two code-less ones); a placement error
   adds the call's id in a top-level `hugpy`.
3. Every reply names the call's id (`hugpy.request_id`); its texts are fixed (REPLY_TEXT,
   STREAM_TOKEN, SPEECH_BYTES), never derived from the input.
4. Usage is OpenAI's, cached prompt tokens included (the box runs llama.cpp behind an OpenAI
   API); a prompt the box did not count reports PROMPT_TOKENS.
5. A task route's fields are JSON, or the text parts of a multipart body (§8: JSON-decoded
   when they start with `[` or `{`); file parts are skipped unread.
"""

from __future__ import annotations

import json
import time
from email.parser import BytesParser
from email.policy import HTTP as EMAIL_HTTP_POLICY
from typing import Any, Callable

from router.sim.connection import Exchange
from router.sim.hugpy_inventory import model_path
from router.sim.prefix_cache import Prefill
from router.sim.wire import CT_JSON, PROMPT_TOKENS, STREAM_TOKEN, json_body as _json, sse_frame

REPLY_TEXT = "This is a simulated reply."
SPEECH_BYTES = bytes(range(256)) * 16  # every byte value, so a relay that decodes text breaks

# Canned bodies (§1, §4, §6), built once.
NOT_FOUND = _json({"error": {"message": "not found", "code": 404}})
BAD_WAIT = _json({"error": {"message": "wait and since must be numbers", "code": 400}})
KEY_REQUIRED = _json({"error": {
    "message": "an API key is required from here: send Authorization: Bearer hpk_…",
    "type": "invalid_request_error", "code": "invalid_api_key"}})
KEY_INVALID = _json({"error": {
    "message": "invalid, expired or revoked API key",
    "type": "invalid_request_error", "code": "invalid_api_key"}})
CHAT_REQUIRED = _json({"error": {"message": "model and messages required", "code": 400}})
MODEL_REQUIRED = _json({"error": {"message": "model required", "code": 400}})
# §11: the box has no do_PUT & co: Python's http.server answers 501 in HTML (%s: the method).
UNSUPPORTED = (b'<!DOCTYPE HTML>\n<html lang="en">\n    <head>\n        <meta charset="utf-8">\n'
               b"        <title>Error response</title>\n    </head>\n    <body>\n        <h1>Error response</h1>\n"
               b"        <p>Error code: 501</p>\n        <p>Message: Unsupported method ('%s').</p>\n"
               b"        <p>Error code explanation: 501 - Server does not support this operation.</p>\n"
               b"    </body>\n</html>\n")
CT_UNSUPPORTED = b"text/html;charset=utf-8"
# §8: a close-delimited SSE head; the call's id and the blank line follow.
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\n"
    b"X-Accel-Buffering: no\r\n"
    b"Connection: close\r\n"
    b"X-Hugpy-Execution-Request-Id: "
)


def error_fields(type: str | None, message: str, code: int | str | None) -> dict[str, Any]:
    """The `error` object (rule 2)."""
    error: dict[str, Any] = {"message": message}
    if type is not None:
        error["type"] = type
    if code is not None:
        error["code"] = code
    return error


def placement_error(rid: str, type: str | None, message: str, code: int | str | None) -> bytes:
    """§4.1: a placement error carries the call's id in a top-level `hugpy`."""
    return _json({"error": error_fields(type, message, code), "hugpy": {"request_id": rid}})


def usage(prefill: Prefill, completion_tokens: int) -> dict[str, Any]:
    """Rule 4."""
    prompt_tokens = prefill.prompt_tokens or PROMPT_TOKENS
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": prefill.cached_tokens}}


# -- stream frames (§4.3, §8) -----------------------------------------------------------------


def chunk_head(rid: str, base: str) -> dict[str, Any]:
    """The fields every frame of one stream shares."""
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": base}


def role_frame(head: dict[str, Any]) -> bytes:
    return sse_frame({**head, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})


def content_frame(head: dict[str, Any]) -> bytes:
    return sse_frame({**head, "choices": [
        {"index": 0, "delta": {"content": STREAM_TOKEN}, "finish_reason": None}]})


def final_frame(head: dict[str, Any], prefill: Prefill, completion_tokens: int) -> bytes:
    return sse_frame({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                      "usage": usage(prefill, completion_tokens), "hugpy": {"request_id": head["id"]}})


def error_frame(rid: str, base: str, type: str | None, message: str, code: int | str | None) -> bytes:
    """§4.3: a placement refusal in a stream, after the 200 head."""
    return sse_frame({**chunk_head(rid, base), "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}],
                      "error": error_fields(type, message, code), "hugpy": {"request_id": rid}})


# -- whole replies, per route -----------------------------------------------------------------

Reply = Callable[[str, str, Prefill], tuple[bytes, bytes]]  # (base, rid, prefill) -> (type, body)


def chat_reply(base: str, rid: str, prefill: Prefill) -> tuple[bytes, bytes]:
    # §5: a non-stream answer carries the engine's `model`, the GGUF path for llama-server.
    return CT_JSON, _json({
        "id": "chatcmpl-" + rid[3:], "object": "chat.completion", "created": int(time.time()),
        "model": model_path(base),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY_TEXT}, "finish_reason": "stop"}],
        "usage": usage(prefill, 6), "hugpy": {"request_id": rid}})


def _json_reply(make: Callable[[str], dict[str, Any]]) -> Reply:
    def reply(base: str, rid: str, prefill: Prefill) -> tuple[bytes, bytes]:
        return CT_JSON, _json({**make(base), "hugpy": {"request_id": rid}})
    return reply


def _speech_reply(base: str, rid: str, prefill: Prefill) -> tuple[bytes, bytes]:
    return b"audio/wav", SPEECH_BYTES  # §8: raw bytes with the artifact's mime


_IMAGE = _json_reply(lambda base: {"created": int(time.time()), "data": [{"b64_json": "AAAA"}], "artifacts": []})
_TRANSCRIPT = _json_reply(lambda base: {"text": REPLY_TEXT})
TASK_REPLIES: dict[str, Reply] = {
    "/v1/embeddings": _json_reply(lambda base: {
        "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
        "model": base, "usage": {"prompt_tokens": 4, "total_tokens": 4}}),
    "/v1/audio/transcriptions": _TRANSCRIPT,
    "/v1/audio/translations": _TRANSCRIPT,
    "/v1/audio/speech": _speech_reply,
    "/v1/images/generations": _IMAGE,
    "/v1/images/edits": _IMAGE,
    "/v1/images/variations": _IMAGE,
    "/v1/videos/generations": _json_reply(lambda base: {
        "created": int(time.time()), "data": [{"url": "file:///spool/sim/video.mp4", "path": "/spool/sim/video.mp4"}],
        "artifacts": [{"id": "sim-video", "path": "/spool/sim/video.mp4", "mime": "video/mp4"}]}),
    "/v1/summarize": _json_reply(lambda base: {"summary": REPLY_TEXT}),
    "/v1/keywords": _json_reply(lambda base: {"keywords": ["simulated", "reply"]}),
}


def read_fields(ex: Exchange) -> dict[str, Any]:
    """A task route's fields (rule 5). Raises ValueError for a body the box would call a bad
    request body."""
    content_type = ex.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/"):
        fields = json.loads(ex.body or b"{}")
        if not isinstance(fields, dict):
            raise ValueError("expected a JSON object")
        return fields
    message = BytesParser(policy=EMAIL_HTTP_POLICY).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + ex.body)
    if not message.is_multipart():
        raise ValueError("multipart body without parts")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name or part.get_filename() is not None:
            continue
        text = part.get_payload(decode=True).decode("utf-8", "replace")
        fields[name] = json.loads(text) if text[:1] in ("[", "{") else text
    return fields
