"""The answers when no box takes a call (router/serve/proxy.py rule 2), in the facade's shape.

1. No box can serve the call at all: the facade's no-box status with 0.0.4's fields (every box's
   reason and the call's id), which hugpy-core reads.
2. Every box tried refused: the last box's own answer as it was sent; a stream refused by its
   first frame gets the status that refusal stands for (router.core.refusal rule 7), with the
   box's error object (`type`, `code` and its other fields kept), never a 200 that carries an
   error; a transport failure (unreachable, lost, timeout) is a 502 that lists the attempts.
"""

from __future__ import annotations

import logging

from router.core.refusal import in_band_status
from router.core.types import Call, Decision
from router.serve.attempt import Refusal
from router.serve.reply import JSON, Reply

log = logging.getLogger("router.proxy")


async def refuse(reply: Reply, call: Call, decision: Decision) -> None:
    """Rule 1."""
    what = f"box {call.pin}" if call.pin is not None else "no box"
    call_id = reply.record.call_id
    await reply.error(
        reply.facade.no_box_status,
        "no_box",
        f"{what} can serve model {call.model!r}",
        {"type": "no_box", "reasons": decision.reasons_text(), "request_id": call_id},
        turned_away=True,
    )
    if log.isEnabledFor(logging.DEBUG):
        log.debug("call %s refused: %s", call_id, decision.reasons_text())


async def give_up(reply: Reply, last: Refusal | None) -> None:
    """Rule 2."""
    record = reply.record
    if last is None or last.status is None:
        attempts = [{"box": a["box"], "refusal": a.get("refusal")} for a in record.attempts]
        await reply.error(502, last.code if last else "no_box", "no box could take the call", {"attempts": attempts})
        return
    box_name = record.box.name  # type: ignore[union-attr]
    if last.status >= 400:
        record.answered(last.status, last.code)
        await reply.respond(last.status, reply.box_headers(box_name, list(last.headers)), last.body)
        return
    status = in_band_status(last.code, last.frame)
    error = last.frame.get("error") if isinstance(last.frame, dict) else None
    fields = dict(error) if isinstance(error, dict) else {}
    message = fields.pop("message", error if isinstance(error, str) else None)
    if not isinstance(message, str):
        message = "the box refused the call"
    body = reply.facade.shape_error(status, last.code, message, fields)
    headers = [(b"content-type", JSON), (b"x-hugpy-box", box_name.encode()), reply.id_header()]
    record.answered(status, last.code)
    await reply.respond(status, headers, body)
