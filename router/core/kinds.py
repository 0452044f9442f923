"""The box kinds: each one registered description, `KINDS[kind]`, with every part a kind needs.

A kind is:
1. its name rule: how a call's model becomes the box's inventory key (`call_key`), how the
   box's own advertised names are keyed (`inventory_key`), and how a model the router chose (an
   alias's) is written in the body the box gets (`sent_name`) (router.core.names);
2. its refusals: the error `type`s and `code`s that mean "try the next box" (`refusal_types`),
   whether any 404 on a model-bearing route means "the model is not here" (`refusal_404`), and
   the message of a failed load (`no_model_prefix`) (router.core.refusal);
3. its capabilities: what the router may do with such a box beyond proxying (`Capability`).
Its inventory link is the one part with I/O: router.boxes.fleet.LINKS, one row per kind.

Adding a kind: a BoxKind member, a row here, a row in LINKS; tests/test_kinds.py fails until
every registered kind fills every part.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Callable, Mapping, NamedTuple

from router.core.memo import Memo
from router.core.names import (
    exact_call_key,
    exact_key,
    exact_sent_name,
    hugpy_call_key,
    ollama_call_key,
    ollama_key,
    ollama_sent_name,
)
from router.core.refusal_code import RefusalCode as R
from router.core.types import BoxKind


class Capability(StrEnum):
    CALL_ID = "call_id"  # takes the router's call id (`X-Hugpy-Parent-Request-Id`) and cancels by it
    CANCEL = "cancel"  # `POST /v1/requests/<call id>/cancel` ends the call on the box
    RELAY = "relay"  # its management API is relayed under /v1/boxes/<box>/ (serve/admin.py)
    STORE_WATCH = "store_watch"  # its inventory can be read from its local store file (`store`)
    # it keeps its own pair settings and verdicts (router.core.pairs): blocks the router enforces,
    # seats compared by load contract, a fit per model in the load tier, the fleet views
    PAIR_SETTINGS = "pair_settings"


class KindRules(NamedTuple):
    call_key: Callable[[str, str | None], tuple[str, str | None] | None]
    inventory_key: Callable[[str], str | None]
    sent_name: Callable[[str, Mapping[str, str]], str]
    refusal_types: frozenset[R]
    refusal_404: bool
    no_model_prefix: str | None
    capabilities: frozenset[Capability]


KINDS: dict[BoxKind, KindRules] = {
    BoxKind.HUGPY: KindRules(
        call_key=hugpy_call_key,
        inventory_key=exact_key,
        sent_name=exact_sent_name,
        # its placement failures and `worker_reserved` (contracts/hugpy-wrapper.md §4)
        refusal_types=frozenset({
            R.LOAD_ERROR, R.INSUFFICIENT_RESOURCES, R.PROFILE_MATERIALIZING, R.PROFILE_ERROR,
            R.ENGINE_UNAVAILABLE, R.FIRST_CALL_EXCLUSIVE, R.CENTRAL_SOURCE_CONSTRAINT, R.MAINTENANCE,
            R.NOT_FOUND_ERROR, R.WORKER_RESERVED,
        }),
        refusal_404=False,  # only its "model not found on this box" (router.core.refusal rule 4)
        no_model_prefix=None,
        capabilities=frozenset({Capability.CALL_ID, Capability.CANCEL, Capability.RELAY, Capability.STORE_WATCH,
                                Capability.PAIR_SETTINGS}),
    ),
    BoxKind.OLLAMA: KindRules(
        call_key=ollama_call_key,
        inventory_key=ollama_key,
        sent_name=ollama_sent_name,
        refusal_types=frozenset({R.NOT_FOUND_ERROR}),
        refusal_404=True,  # a 404 on a model-bearing route: a stale inventory
        no_model_prefix=None,
        capabilities=frozenset(),
    ),
    BoxKind.LMSTUDIO: KindRules(
        call_key=exact_call_key,
        inventory_key=exact_key,
        sent_name=exact_sent_name,
        refusal_types=frozenset({R.MODEL_NOT_FOUND}),
        refusal_404=False,
        no_model_prefix="No models loaded",  # a failed JIT load
        capabilities=frozenset(),
    ),
    BoxKind.OPENAI: KindRules(
        call_key=exact_call_key,
        inventory_key=exact_key,
        sent_name=exact_sent_name,
        refusal_types=frozenset({R.MODEL_NOT_FOUND, R.NOT_FOUND_ERROR}),
        refusal_404=False,
        no_model_prefix=None,
        capabilities=frozenset(),
    ),
}


# call_key per (kind, model, body settings), remembered (router.core.memo): a call's key is read
# by its decision, its box's lesson and affinity's outcome; the call path reads it here directly.
CALL_KEYS = Memo(lambda asked: KINDS[asked[0]].call_key(asked[1], asked[2]), 4096)


def call_key(kind: BoxKind, model: str, body_settings: str | None) -> tuple[str, str | None] | None:
    """(key, settings) for a call's model on a box of `kind`, or None if the name is invalid
    there (the kind's name rule)."""
    return CALL_KEYS[(kind, model, body_settings)]


def inventory_key(kind: BoxKind, advertised: str) -> str | None:
    """The key under which a box's own advertised name is stored in its inventory view."""
    return KINDS[kind].inventory_key(advertised)


def can(kind: BoxKind, capability: Capability) -> bool:
    return capability in KINDS[kind].capabilities


def kinds_that(capability: Capability) -> frozenset[BoxKind]:
    """The kinds that can do `capability`: the call path's question `kind in kinds_that(...)`,
    asked of a set made once at import, costs no frame (`can` does)."""
    return frozenset(kind for kind, spec in KINDS.items() if capability in spec.capabilities)
