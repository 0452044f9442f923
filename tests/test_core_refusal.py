"""Which box answers are refusals (router/core/refusal.py), with the contracts' exact bodies:
contracts/hugpy-wrapper.md §4, contracts/ollama-lmstudio.md §1.5, §3.6 and A.3."""

from __future__ import annotations

import orjson
import pytest

from router.core.refusal import (
    RefusalCode,
    api_error,
    classify_first_frame,
    classify_reply,
    in_band_status,
)
from router.core.types import BoxKind

MODEL_NOT_FOUND, NO_MODEL_LOADED, STREAM_ERROR = (
    RefusalCode.MODEL_NOT_FOUND, RefusalCode.NO_MODEL_LOADED, RefusalCode.STREAM_ERROR)

HUGPY, OLLAMA, LMSTUDIO, OPENAI = BoxKind.HUGPY, BoxKind.OLLAMA, BoxKind.LMSTUDIO, BoxKind.OPENAI

REPLIES = [
    # --- hugpy §4.2 -------------------------------------------------------------------------
    (
        "hugpy 404 typed not found",
        HUGPY,
        404,
        b'{"error":{"message":"model not found on this box: X","type":"not_found_error",'
        b'"code":404},"hugpy":{"request_id":"fe-1"}}',
        "not_found_error",
    ),
    (
        "hugpy 404 untyped not found (model@opts)",
        HUGPY,
        404,
        b'{"error":{"message":"model not found on this box: X@ram-only","code":404}}',
        MODEL_NOT_FOUND,
    ),
    (
        "hugpy 503 insufficient_resources",
        HUGPY,
        503,
        b'{"error":{"message":"won\'t fit: needs 9 GiB","type":"insufficient_resources",'
        b'"code":503},"hugpy":{"request_id":"fe-2"}}',
        "insufficient_resources",
    ),
    (
        "hugpy 503 insufficient_resources without code",
        HUGPY,
        503,
        b'{"error":{"message":"CPU admission: 0 obtainable physical cores < minimum 1",'
        b'"type":"insufficient_resources"}}',
        "insufficient_resources",
    ),
    (
        "hugpy 503 load_error",
        HUGPY,
        503,
        b'{"error":{"message":"load failed: child exited rc=1: ... exiting due to model loading '
        b'error","type":"load_error","code":503},"hugpy":{"request_id":"fe-3"}}',
        "load_error",
    ),
    (
        "hugpy 503 profile_materializing",
        HUGPY,
        503,
        b'{"error":{"message":"load failed: {\\"type\\":\\"profile_materializing\\"}",'
        b'"type":"profile_materializing","code":503,"profile":"videogen","base":"isolated",'
        b'"state":"building","packages":[]}}',
        "profile_materializing",
    ),
    (
        "hugpy 503 first_call_exclusive (string code)",
        HUGPY,
        503,
        b'{"error":{"message":"first call for X is admitted exclusively","type":'
        b'"first_call_exclusive","code":"first_call_exclusive"}}',
        "first_call_exclusive",
    ),
    (
        "hugpy 503 maintenance",
        HUGPY,
        503,
        b'{"error":{"message":"Wrapper is installing an approved update; retry shortly",'
        b'"type":"maintenance","code":503}}',
        "maintenance",
    ),
    (
        "hugpy 423 worker_reserved",
        HUGPY,
        423,
        b'{"error":{"message":"worker reserved for fit station","type":"worker_reserved",'
        b'"code":423}}',
        "worker_reserved",
    ),
    (
        "hugpy 502 upstream_error",
        HUGPY,
        502,
        b'{"error":{"message":"engine failed","type":"upstream_error","code":502}}',
        "http_502",
    ),
    (
        "hugpy 400 bad json",
        HUGPY,
        400,
        b'{"error": {"message": "bad json: Expecting property name enclosed in double quotes: '
        b'line 1 column 2 (char 1)", "code": 400}}',
        None,
    ),
    (
        "hugpy 400 unknown option",
        HUGPY,
        400,
        b'{"error": {"message": "unknown or infeasible option(s) bogus for tiny-llama on this '
        b'box", "type": "invalid_request_error", "code": 400}}',
        None,
    ),
    (
        "hugpy 400 placement_unsupported",
        HUGPY,
        400,
        b'{"error":{"message":"split","type":"placement_unsupported","code":400}}',
        None,
    ),
    (
        "hugpy 404 unknown route",
        HUGPY,
        404,
        b'{"error": {"message": "not found", "code": 404}}',
        None,
    ),
    (
        "hugpy 499 cancelled",
        HUGPY,
        499,
        b'{"error":{"message":"request cancelled","code":499},"hugpy":{"request_id":"fe-4"}}',
        None,
    ),
    (
        "hugpy 500 unhandled",
        HUGPY,
        500,
        b'{"error":{"message":"KeyError(\'x\')","code":500}}',
        None,
    ),
    # --- ollama §1.5, A.3 -------------------------------------------------------------------
    ("ollama 404 not found", OLLAMA, 404, b'{"error":"model \'nope\' not found"}', MODEL_NOT_FOUND),
    (
        "ollama 404 embed not found",
        OLLAMA,
        404,
        b'{"error":"model \\"nope\\" not found, try pulling it first"}',
        MODEL_NOT_FOUND,
    ),
    (
        "ollama /v1 404 not_found_error",
        OLLAMA,
        404,
        b'{"error":{"message":"model \'nope\' not found","type":"not_found_error","param":null,'
        b'"code":null}}',
        "not_found_error",
    ),
    (
        "ollama 503 server busy",
        OLLAMA,
        503,
        b'{"error":"server busy, please try again.  maximum pending requests exceeded"}',
        "http_503",
    ),
    ("ollama 400 model required", OLLAMA, 400, b'{"error":"model is required"}', None),
    ("ollama 400 invalid name", OLLAMA, 400, b'{"error":"invalid model name"}', None),
    ("ollama 499 canceled", OLLAMA, 499, b'{"error":"request canceled"}', None),
    (
        "ollama 500 runner stopped",
        OLLAMA,
        500,
        b'{"error":"model runner has unexpectedly stopped, this may be due to resource '
        b'limitations"}',
        None,
    ),
    # --- lmstudio §3.6 -----------------------------------------------------------------------
    (
        "lmstudio 400 model_not_found",
        LMSTUDIO,
        400,
        b'{"error":{"message":"Invalid model identifier \\"o4-mini\\". Please specify a valid '
        b'downloaded model (e.g., a, b, c).","type":"invalid_request_error","param":"model",'
        b'"code":"model_not_found"}}',
        "model_not_found",
    ),
    (
        "lmstudio 404 model_not_found (0.3.5)",
        LMSTUDIO,
        404,
        b'{"error":{"message":"Model \\"local model\\" not found. Please specify a valid model.",'
        b'"type":"invalid_request_error","param":"model","code":"model_not_found"}}',
        "model_not_found",
    ),
    (
        "lmstudio No models loaded (string)",
        LMSTUDIO,
        400,
        b'{"error":"No models loaded. Please load a model in the developer page or use the '
        b'\'lms load\' command."}',
        NO_MODEL_LOADED,
    ),
    (
        "lmstudio No models loaded (object)",
        LMSTUDIO,
        400,
        b'{"error":{"message":"No models loaded. Please load a model.","type":'
        b'"invalid_request_error","param":"model","code":null}}',
        NO_MODEL_LOADED,
    ),
    (
        "lmstudio 401 token",
        LMSTUDIO,
        401,
        b'{"error":{"type":"invalid_request","code":"invalid_api_key","message":"An LM Studio '
        b'API token is required"}}',
        None,
    ),
    (
        "lmstudio 400 other",
        LMSTUDIO,
        400,
        b'{"error":{"message":"bad","type":"invalid_request_error","code":null}}',
        None,
    ),
    # --- openai ------------------------------------------------------------------------------
    (
        "openai 404 not_found_error",
        OPENAI,
        404,
        b'{"error":{"message":"The model `x` does not exist","type":"not_found_error",'
        b'"param":null,"code":null}}',
        "not_found_error",
    ),
    (
        "openai 404 model_not_found code",
        OPENAI,
        404,
        b'{"error":{"message":"The model `x` does not exist","type":"invalid_request_error",'
        b'"param":"model","code":"model_not_found"}}',
        "model_not_found",
    ),
    ("openai 504", OPENAI, 504, b"<html>gateway timeout</html>", "http_504"),
    (
        "openai 400",
        OPENAI,
        400,
        b'{"error":{"message":"bad","type":"invalid_request_error","code":null}}',
        None,
    ),
]


def parse(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


@pytest.mark.parametrize(
    "kind,status,body,expected", [r[1:] for r in REPLIES], ids=[r[0] for r in REPLIES]
)
def test_classify_reply(kind, status, body, expected):
    assert classify_reply(kind, status, parse(body)) == expected


@pytest.mark.parametrize("kind", list(BoxKind))
@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_statuses_refuse_whatever_the_body(kind, status):
    for body in (None, {}, [], "x", {"error": 1}, {"error": {"type": 3}}):
        assert classify_reply(kind, status, body) == f"http_{status}"


@pytest.mark.parametrize("kind", list(BoxKind))
@pytest.mark.parametrize("status", [400, 401, 403, 422, 429, 499, 500])
def test_other_statuses_with_odd_bodies_pass_back(kind, status):
    for body in (None, {}, [], "x", {"error": None}, {"error": {"message": 7}}):
        assert classify_reply(kind, status, body) is None


def test_refusal_types_are_per_kind():
    """A hugpy-only type from another kind is the client's answer."""
    body = {"error": {"message": "x", "type": "worker_reserved", "code": 423}}
    assert classify_reply(HUGPY, 423, body) == "worker_reserved"
    assert classify_reply(OLLAMA, 423, body) is None
    assert classify_reply(OPENAI, 423, body) is None
    # "model not found on this box" is hugpy's wording; only a 404 counts
    untyped = {"error": {"message": "model not found on this box: X", "code": 404}}
    assert classify_reply(HUGPY, 400, untyped) is None


FRAMES = [
    (
        "hugpy error frame §4.3",
        HUGPY,
        b'{"id": "fe-7b81", "object": "chat.completion.chunk", "created": 1795958114, "model": '
        b'"nope", "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}], "error": '
        b'{"message": "model not found on this box: nope", "type": "not_found_error", "code": '
        b'404}, "hugpy": {"request_id": "fe-7b81"}}',
        "not_found_error",
    ),
    (
        "hugpy in-band insufficient_resources",
        HUGPY,
        b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "error"}], "error": '
        b'{"message": "won\'t fit", "type": "insufficient_resources", "code": 503}}',
        "insufficient_resources",
    ),
    (
        "finish_reason error without error object",
        OPENAI,
        b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]}',
        STREAM_ERROR,
    ),
    (
        "ollama error line",
        OLLAMA,
        b'{"error":"an error was encountered while running the model"}',
        STREAM_ERROR,
    ),
    (
        "openai-style error frame with code only",
        OPENAI,
        b'{"error":{"message":"x","code":"model_not_found"}}',
        "model_not_found",
    ),
    (
        "lmstudio v1 error event",
        LMSTUDIO,
        b'{"type":"error","error":{"type":"model_not_found","message":"x"}}',
        "model_not_found",
    ),
    (
        "normal role frame",
        HUGPY,
        b'{"id":"fe-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"role":"assistant","content":""},"finish_reason":null}]}',
        None,
    ),
    (
        "ollama normal line",
        OLLAMA,
        b'{"model":"llama3","message":{"role":"assistant","content":"Hi"},"done":false}',
        None,
    ),
    (
        "finish_reason stop",
        OPENAI,
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        None,
    ),
    ("DONE marker", OPENAI, b"[DONE]", None),
    ("empty choices", OPENAI, b'{"choices":[]}', None),
]


@pytest.mark.parametrize(
    "kind,frame,expected", [r[1:] for r in FRAMES], ids=[r[0] for r in FRAMES]
)
def test_classify_first_frame(kind, frame, expected):
    assert classify_first_frame(kind, parse(frame)) == expected


def test_first_frame_odd_shapes():
    for frame in (None, [], "error", 3, {"choices": "x"}, {"choices": [1]}):
        assert classify_first_frame(OPENAI, frame) is None


# -- rule 7: the status an in-band refusal stands for, when no box is left ----------------------


@pytest.mark.parametrize(("refusal", "frame", "status"), [
    ("load_error", {"error": {"type": "load_error", "code": 503}}, 503),
    ("not_found_error", {"error": {"type": "not_found_error", "code": 404}}, 404),
    ("worker_reserved", {"error": {"type": "worker_reserved", "code": 423}}, 423),
    ("first_call_exclusive", {"error": {"type": "first_call_exclusive", "code": "first_call_exclusive"}}, 503),
    ("not_found_error", {"error": {"type": "not_found_error"}}, 404),
    ("model_not_found", {"error": {"code": "model_not_found"}}, 404),
    ("stream_error", {"error": "runner crashed"}, 502),
    ("stream_error", {"error": {"message": "boom", "code": 500}}, 502),  # a box's 500 is a bad gateway
    ("stream_error", {"error": {"code": True}}, 502),
    ("stream_error", {"choices": [{"finish_reason": "error"}]}, 502),
])
def test_in_band_status(refusal, frame, status):
    assert in_band_status(refusal, frame) == status


@pytest.mark.parametrize("doc, shown", [
    ({"error": {"message": "bad", "type": "invalid_request_error"}}, True),  # OpenAI, hugpy, LM Studio
    ({"error": "model is required"}, True),  # Ollama, LM Studio
    ({"object": "error", "message": "too long", "code": 400}, True),  # vLLM's and SGLang's older shape
    ({"error": {"traceback": "DB_PASSWORD=hunter2"}}, False),
    ({"detail": "DB_PASSWORD=hunter2"}, False),
    ({"error": None}, False),
    (["error"], False),
    (None, False),  # not JSON: a traceback, an HTML page
])
def test_only_an_apis_error_shape_goes_back_as_the_box_sent_it(doc, shown):
    assert api_error(doc) is shown
