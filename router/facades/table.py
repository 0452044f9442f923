"""What a facade is: a table of routes onto the one proxy path, plus its error shape.

A model-bearing route names where its model is (`body` and `model_fields`, first present
wins); a fleet route carries the function that answers from the router's own view (`answer`).
Every row names the access scope it needs (router.core.access): `public` (liveness probes),
`use` (inference and listings, the default) or `admin` (engine management). Adding an endpoint
means adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, Iterable, NamedTuple, Sequence

import orjson

from router.core.aliases import Alias
from router.core.kinds import Capability, can
from router.core.types import BoxKind


class Body(IntEnum):
    JSON = 1  # model in the JSON body
    FORM = 2  # multipart form field `model`, or a JSON body


# answer(boxes, path) -> (status, content type, body); `boxes` are the online, unblocked boxes
# of the facade's kinds in boxes-file order (router.boxes.state.BoxState).
FleetAnswer = Callable[[Sequence, str], tuple[int, bytes, bytes]]


class AliasListing(NamedTuple):
    """How a model list shows aliases: the list's member in the answer, and one alias's row in
    the facade's shape (marked `"alias": true`, with its `chain`)."""

    member: str
    row: Callable[[Alias], dict]


def with_aliases(body: bytes, listing: AliasListing, aliases: Iterable[Alias]) -> bytes:
    """A model list answer `body` with a row per alias after the models."""
    doc = orjson.loads(body)
    doc[listing.member].extend(listing.row(alias) for alias in aliases)
    return orjson.dumps(doc)


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    body: Body | None = None
    model_fields: tuple[str, ...] = ("model",)
    answer: FleetAnswer | None = None
    prefix: bool = False  # the path is a prefix (`/api/v0/models/` + a model id)
    scope: str = "use"  # access scope: "public", "use" or "admin"
    aliases: AliasListing | None = None  # a model list: the aliases are listed too
    # an OpenAI-shaped stream whose usage the box gives only when asked (facades/usage.py rule 2)
    asks_usage: bool = False
    # every field where a box serving the route reads the answer's bound in tokens
    # (`options.num_predict`: a member of `options`); the first is the one every such box reads,
    # which the router adds when it bounds an answer the body states no bound for (serve/limits.py
    # rule 2)
    answer_bound: tuple[str, ...] = ()
    # a model no box of the facade's kinds lists: the engine's own words for it, which go out as
    # a 404 (serve/no_box.py rule 1); None: the facade's no-box answer
    model_not_found: Callable[[str], str] | None = None
    # the top-level members `answer_bound` lives in, for the body's one scan
    bound_members: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        members = tuple(dict.fromkeys(name.partition(".")[0] for name in self.answer_bound))
        object.__setattr__(self, "bound_members", members)


# Every top-level field an OpenAI-shaped box reads as its answer's bound, whatever the route: the
# router reads them all (the largest counts) and, bounding an answer, writes them all (serve/limits.py
# rule 2), so no box's order of reading them matters. `max_tokens` (every box); its newer name
# `max_completion_tokens` (vLLM and SGLang read `max_completion_tokens or max_tokens`, hugpy both);
# `max_output_tokens` (the Responses API, LM Studio's /api/v1/chat); llama.cpp's `n_predict`, which it
# reads before `max_tokens` on every route.
OPENAI_BOUND_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")


def openai_bound(written: str) -> tuple[str, ...]:
    """A route's `answer_bound`: OPENAI_BOUND_FIELDS with `written` first, the field every box
    serving the route reads, which the router adds to a body stating none."""
    return (written,) + tuple(name for name in OPENAI_BOUND_FIELDS if name != written)


CHAT_BOUND = openai_bound("max_tokens")  # chat, completions and Messages
RESPONSES_BOUND = openai_bound("max_output_tokens")  # the Responses API, LM Studio's /api/v1/chat


def _no_settings(doc: dict) -> str | None:
    return None


@dataclass(frozen=True)
class Facade:
    name: str
    kinds: frozenset[BoxKind]
    routes: Sequence[Route]
    no_box_status: int
    # shape_error(status, code, message, extra) -> JSON body bytes in the facade's own shape
    shape_error: Callable[[int, str, str, dict | None], bytes]
    # settings(body) -> the settings a call asks for beyond its model name (None = default),
    # from the body's top-level `settings_fields` (the only other members the router reads)
    settings: Callable[[dict], str | None] = _no_settings
    settings_fields: tuple[str, ...] = ()
    # what an unknown route gets: (status, body) for a method and path; None = 404/405 error
    unknown: Callable[[str, str], tuple[int, bytes]] | None = None
    # its streams are SSE, whose comments can keep a long wait alive (NDJSON has no comments)
    sse_keepalive: bool = False
    # whole_as_stream(body) -> a box's whole 2xx answer as the frames of the stream the call
    # asked for, ending it (None: the stream cannot carry it); for a kept-alive stream's head
    whole_as_stream: Callable[[bytes], bytes | None] | None = None
    # its JSON bodies' top-level `knobs` object is a hugpy box's per-call load contract
    # (router.core.pairs rule 4): read into Call.knobs, so a box's tiers can compare it
    reads_knobs: bool = False
    _exact: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._exact.update({(r.method, r.path): r for r in self.routes if not r.prefix})

    def route(self, method: str, path: str) -> tuple[Route | None, bool]:
        """(route, path known): a known path with another method is a 405, not a 404."""
        found = self._exact.get((method, path))
        if found is not None:
            return found, True
        for route in self.routes:
            if route.prefix and path.startswith(route.path) and route.method == method:
                return route, True
        return None, self._known(path)

    def _known(self, path: str) -> bool:
        """`path` is a route's with another method. (A method of its own: its generator would
        make `path` a cell, allocated on every call of `route`.)"""
        return any(r.path == path or (r.prefix and path.startswith(r.path)) for r in self.routes)

    def serving(self, kinds: frozenset[BoxKind], no_box_status: int, name: str) -> "Facade":
        """The same routes restricted to some box kinds (a dedicated engine listener)."""
        reads_knobs = self.reads_knobs and any(can(kind, Capability.PAIR_SETTINGS) for kind in kinds)
        return Facade(name, kinds, self.routes, no_box_status, self.shape_error, self.settings,
                      self.settings_fields, self.unknown, self.sse_keepalive, self.whole_as_stream, reads_knobs)

    def keeping(self, paths: frozenset[str], name: str) -> "Facade":
        """Only the routes of `paths`, every other path a 404 in the facade's shape (the health
        listener: a listener that must be no way around the others)."""
        routes = tuple(route for route in self.routes if route.path in paths)
        return Facade(name, self.kinds, routes, self.no_box_status, self.shape_error)
