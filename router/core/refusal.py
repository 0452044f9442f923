"""Which box answers are refusals (try the next box) and which go back to the client as sent.

Rules, for an answer that arrives before any byte reached the client:
1. Transport: unreachable, connection lost before the head, first-byte timeout → refusal.
2. Status 502, 503, 504 from any kind → refusal.
3. An error whose `type` or `code` is in the kind's refusal set → refusal (hugpy: its
   placement failures and `worker_reserved`; ollama, lmstudio, openai: model not found).
4. A 404 that says the model is not there → refusal: any 404 from an ollama box on a
   model-bearing route (stale inventory), hugpy's "model not found on this box" (typed or not).
5. LM Studio's "No models loaded" (a failed JIT load) → refusal.
6. A stream's first frame with a top-level `error`, or `finish_reason: "error"` → refusal.
Everything else (a 400, a 401, a 499 …) is the client's answer, passed back exactly when it is
an API's error (rule 8).
The returned code is a short stable string used in logs, the store and 503 bodies.

When no box is left to try, the client gets the status the last refusal stands for, never a
200 carrying an error: a refusal with a real status keeps it; an in-band one (rule 6) gets
`in_band_status` (rule 7).
7. An in-band error's own `code`, when it is a status a client can act on (a 4xx, or 502, 503,
   504: hugpy writes `"code": 503` for a load error), else by the refusal: not found → 404,
   `worker_reserved` → 423, any other placement refusal → 503 (the box is there but cannot
   place the model now), an error we do not know → 502 (the box failed).
8. A box's error answer that goes to the client (rule 6's "everything else", or the last
   refusal's) goes as the box sent it only in an API's error shape (`api_error`): OpenAI's
   `{"error": {"message": "…", …}}` (hugpy's, LM Studio's, llama.cpp's, vLLM's), Ollama's and
   LM Studio's `{"error": "…"}`, or the older vLLM's and SGLang's `{"object": "error",
   "message": "…"}`. Any other body (a traceback, an HTML page, a proxy's text) is not an answer
   the box's API gives: the client gets the router's error naming the box and its status.
"""

from __future__ import annotations

from typing import Any

from router.core.kinds import KINDS
from router.core.refusal_code import RefusalCode
from router.core.types import BoxKind


R = RefusalCode
REFUSAL_STATUSES = frozenset({502, 503, 504})
# Rule 7's statuses by refusal code; a code not listed and in no kind's refusal types is 502.
IN_BAND_STATUSES = {R.NOT_FOUND_ERROR: 404, R.MODEL_NOT_FOUND: 404, R.WORKER_RESERVED: 423}

# Refusals that say "no room for this model here now" (hugpy's placement failures, a 503 such
# as Ollama's "server busy", LM Studio's failed JIT load): the box is full for the model for a
# back-off (router.core.admission rule 7) instead of drawing the next call at once.
PLACEMENT_REFUSALS = frozenset({R.INSUFFICIENT_RESOURCES, R.WORKER_RESERVED, R.HTTP_503, R.NO_MODEL_LOADED})

# A kind's refusal types, its 404 rule and its no-model message are its description's
# (router.core.kinds).
HUGPY_NOT_FOUND_PREFIX = "model not found on this box"


def _error_fields(body: Any) -> tuple[str | None, str | None, str]:
    """(type, code, message) of an `{"error": ...}` body; the error may be a string or object."""
    if not isinstance(body, dict):
        return None, None, ""
    error = body.get("error")
    if isinstance(error, str):
        return None, None, error
    if not isinstance(error, dict):
        return None, None, ""
    etype, code, message = error.get("type"), error.get("code"), error.get("message")
    return (
        etype if isinstance(etype, str) else None,
        code if isinstance(code, str) else None,
        message if isinstance(message, str) else "",
    )


def api_error(doc: Any) -> bool:
    """Rule 8: `doc` (a box's error body, parsed; None when it is not JSON) is in an API's error
    shape."""
    if not isinstance(doc, dict):
        return False
    error = doc.get("error")
    if isinstance(error, str):
        return True
    if isinstance(error, dict):
        return isinstance(error.get("message"), str)
    return doc.get("object") == "error" and isinstance(doc.get("message"), str)


def classify_reply(kind: BoxKind, status: int, body: Any) -> RefusalCode | None:
    """Returns a refusal code for a non-2xx answer (`body` = its parsed JSON or None), or None."""
    etype, code, message = _error_fields(body)
    rules = KINDS[kind]
    refusal_types = rules.refusal_types
    if etype in refusal_types:
        return RefusalCode(etype)
    if code in refusal_types:
        return RefusalCode(code)
    if status in REFUSAL_STATUSES:
        return RefusalCode(f"http_{status}")
    if status == 404:
        if rules.refusal_404 or message.startswith(HUGPY_NOT_FOUND_PREFIX):
            return R.MODEL_NOT_FOUND
    if rules.no_model_prefix is not None and message.startswith(rules.no_model_prefix):
        return R.NO_MODEL_LOADED
    return None


def classify_first_frame(kind: BoxKind, frame: Any) -> RefusalCode | None:
    """Returns a refusal code when a stream's first frame reports an error, else None."""
    if not isinstance(frame, dict):
        return None
    if "error" in frame:
        etype, code, _ = _error_fields(frame)
        known = KINDS[kind].refusal_types
        # Only codes we know become the refusal's code: the box's own text never reaches a log
        # row or a metrics label.
        return RefusalCode(etype) if etype in known else RefusalCode(code) if code in known else R.STREAM_ERROR
    choices = frame.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        if choices[0].get("finish_reason") == "error":
            return R.STREAM_ERROR
    return None


def in_band_status(refusal: RefusalCode, frame: Any) -> int:
    """The HTTP status for a stream refused by its first frame `frame` (parsed JSON) with the
    refusal code `refusal` from classify_first_frame, when no box is left to try (rule 7)."""
    error = frame.get("error") if isinstance(frame, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and not isinstance(code, bool) and (400 <= code < 500 or code in REFUSAL_STATUSES):
        return code
    if refusal in IN_BAND_STATUSES:
        return IN_BAND_STATUSES[refusal]
    if any(refusal in rules.refusal_types for rules in KINDS.values()):
        return 503
    return 502
