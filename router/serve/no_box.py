"""The answers when no box takes a call (router/serve/proxy.py rule 2), in the facade's shape.

1. No box can serve the call at all: the facade's no-box status with 0.0.4's fields (every box's
   reason and the call's id), which hugpy-core reads. Three cases say what is wrong instead: a
   pin to a box that is not in the fleet is a 404 `unknown_box` naming it and the fleet's
   boxes; an empty fleet says so and names the boxes file read; and where the route has its
   engine's words for a model that engine lacks (Route.model_not_found: Ollama's), a model no
   box of the call's kinds lists is a 404 `model_not_found` in those words, the reasons kept
   beside them (an alias or a pin keeps the no-box answer: the name is the router's own).
2. Every box tried refused: the last box's own answer as it was sent when it is an API's error
   (reply.py rule 5, else the router's `box_error`); a stream refused by its
   first frame gets the status that refusal stands for (router.core.refusal rule 7), with the
   box's error object (`type`, `code` and its other fields kept), never a 200 that carries an
   error; a transport failure (unreachable, lost, timeout) is a 502 that lists the attempts.
"""

from __future__ import annotations

import logging

from router.boxes.aliases import served_by
from router.boxes.fleet import Fleet
from router.core.bounds import ECHO_CHARS, clip
from router.core.refusal import in_band_status
from router.core.types import Call, Decision, ReasonCode
from router.serve.attempt import Refusal
from router.serve.reply import JSON, Reply

log = logging.getLogger("router.proxy")


async def refuse(reply: Reply, call: Call, decision: Decision, fleet: Fleet) -> None:
    """Rule 1."""
    call_id, alias = reply.record.call_id, reply.record.alias
    not_found = reply.record.route.model_not_found
    if not_found is not None and alias is None and call.pin is None and decision.ruled_out and not served_by(
            (box for box in fleet.ordered() if box.config.kind in call.kinds), call.model):
        await reply.error(404, "model_not_found", not_found(clip(call.model, ECHO_CHARS)),
                          {"type": "model_not_found", "reasons": decision.reasons_text(), "request_id": call_id},
                          turned_away=True)
        return
    named = f"model {call.model!r}" if alias is None else f"alias {alias!r} (nor any model of its chain)"
    pinned = decision.ruled_out.get(call.pin) if call.pin is not None else None
    if pinned is not None and pinned.code is ReasonCode.UNKNOWN_BOX:
        others = ", ".join(box for box in decision.ruled_out if box != call.pin) or "none"
        await reply.error(
            404, "unknown_box", f"no box named {clip(call.pin, ECHO_CHARS)!r} in the fleet (its boxes: {others})",
            {"type": "unknown_box", "reasons": decision.reasons_text(), "request_id": call_id}, turned_away=True,
        )
        return
    if pinned is not None:
        message = f"box {call.pin} cannot serve {named}: {pinned.text()}"
    else:
        message = f"no box can serve {named}"
    if not decision.ruled_out:
        message += f": the fleet is empty (no boxes in {fleet.path})"
    await reply.error(
        reply.facade.no_box_status,
        "no_box",
        message,
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
        await reply.box_error(box_name, last.status, list(last.headers), last.body)
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
