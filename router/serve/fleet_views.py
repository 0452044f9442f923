"""What the router knows of each hugpy box's own settings and verdicts, in one place for hugpy-core:
the admin state's per-box lines and the fleet views (contracts/hugpy-wrapper.md §11).

Rules:
1. `GET /v1/fleet/verdicts[?model=K]` and `GET /v1/fleet/settings[?model=K]` answer from the
   router's own cache (the verdicts its links read, the pair settings the state long-poll or
   the store watch keeps current): no box is asked per request. `GET /v1/fleet/residents` asks
   every hugpy box's `/residents` at once (the cache keeps only what routing needs), each
   within `ASK_TIMEOUT_S`.
2. Every row carries its `box`. A box with nothing to show is listed under `unanswered` with
   why (offline, its verdicts could not be read, it did not answer), never silently left out.
3. Only boxes of a kind with its own pair settings and verdicts (hugpy) are listed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import orjson

from router.core.kinds import Capability, can
from router.core.pairs import BLANKET_KEY, blocked_by, effective
from router.upstream.fetch import fetch

if TYPE_CHECKING:  # not the app's type: the app imports this module (through the dashboard)
    from router.boxes.state import BoxState
    from router.serve.edge import Edge

ASK_TIMEOUT_S = 5.0
JSON = (b"content-type", b"application/json")


def box_state(box: BoxState, link) -> dict[str, Any]:
    """A hugpy box's own settings and verdicts for the admin state; {} for other kinds."""
    if not can(box.config.kind, Capability.PAIR_SETTINGS) or link is None:
        return {}
    view = box.inventory.pairs
    return {
        "worker": getattr(link, "worker", None),
        "pair_settings": {key: effective(view, key) for key in sorted(box.catalog)},
        "blocked_models": {key: by for key in sorted(box.catalog) if (by := blocked_by(view, key))},
        "blanket_blocked": view.blanket_blocked,
        "verdicts": link.verdicts.state(),
        "loaded_under": box.loaded,
    }


def _hugpy(app) -> list[tuple[BoxState, Any]]:
    fleet = app.process.fleet
    return [(box, fleet.links.get(box.name)) for box in fleet.ordered() if can(box.config.kind, Capability.PAIR_SETTINGS)]


def _model(edge: Edge) -> str | None:
    for part in edge.query.split("&"):
        name, _, value = part.partition("=")
        if name == "model" and value:
            return unquote(value)
    return None


def _offline(box: BoxState, link) -> str | None:
    if box.online and not box.unreachable:
        return None
    return "offline" + (f" ({link.probe_error})" if link is not None and link.probe_error else "")


async def verdicts(app, edge: Edge) -> None:
    model = _model(edge)
    rows, unanswered = [], []
    for box, link in _hugpy(app):
        why = _offline(box, link)
        reader = getattr(link, "verdicts", None)
        if why is None and (reader is None or reader.read_at is None):
            why = f"verdicts not read: {reader.error}" if reader is not None and reader.error else "verdicts not read yet"
        if why is not None:
            unanswered.append({"box": box.name, "why": why})
            continue
        age = round(max(0.0, time.time() - reader.read_at), 1)
        rows += [{"box": box.name, "read_s_ago": age, **row} for row in reader.rows
                 if model is None or row.get("model_key") == model]
    await edge.respond(200, [JSON], orjson.dumps({"verdicts": rows, "unanswered": unanswered}))


async def settings(app, edge: Edge) -> None:
    model = _model(edge)
    rows, unanswered = [], []
    for box, link in _hugpy(app):
        why = _offline(box, link)
        if why is not None:
            unanswered.append({"box": box.name, "why": why})
            continue
        view = box.inventory.pairs
        keys = [model] if model is not None else sorted(box.catalog)
        rows.append({"box": box.name, "model_key": BLANKET_KEY, "blocked": view.blanket_blocked,
                     "effective": dict(view.blanket)})
        rows += [{"box": box.name, "model_key": key, "blocked": blocked_by(view, key) is not None,
                  "effective": effective(view, key)} for key in keys]
    await edge.respond(200, [JSON], orjson.dumps({"settings": rows, "unanswered": unanswered}))


async def _ask_residents(box: BoxState) -> list[dict] | str:
    """The box's `/residents` rows, or why there are none (rule 2)."""
    try:
        status, _, body = await fetch(box.origin, "GET", "/residents", headers=box.auth_header,
                                      timeout_s=ASK_TIMEOUT_S)
        if status != 200:
            return f"answered {status}"
        found = orjson.loads(body).get("residents")
        return [row for row in found if isinstance(row, dict)] if isinstance(found, list) else "no residents list"
    except Exception as exc:  # whatever broke, the box did not answer (rule 2)
        return f"did not answer ({type(exc).__name__})"


async def residents(app, edge: Edge) -> None:
    boxes = _hugpy(app)
    asked = await asyncio.gather(*(_ask_residents(box) for box, _ in boxes))
    rows, unanswered = [], []
    for (box, link), found in zip(boxes, asked):
        if isinstance(found, str):
            unanswered.append({"box": box.name, "why": _offline(box, link) or found})
        else:
            rows += [{"box": box.name, **row} for row in found]
    await edge.respond(200, [JSON], orjson.dumps({"residents": rows, "unanswered": unanswered}))


ROUTES = {
    ("GET", "/v1/fleet/verdicts"): verdicts,
    ("GET", "/v1/fleet/settings"): settings,
    ("GET", "/v1/fleet/residents"): residents,
}
