"""Every box kind is one registered description (router/core/kinds.py) plus its inventory link
(router/boxes/fleet.py LINKS): a kind that misses a part fails here, not with a KeyError at run
time."""

from __future__ import annotations

import pytest

from router.boxes.fleet import LINKS
from router.boxes.link import Link
from router.core.kinds import KINDS, Capability, KindRules
from router.core.refusal_code import RefusalCode
from router.core.types import BoxKind
from router.facades import mounts
from router.facades.openai import FACADE as OPENAI


@pytest.mark.parametrize("kind", list(BoxKind))
def test_every_kind_fills_every_part(kind):
    rules = KINDS[kind]
    assert isinstance(rules, KindRules)
    assert callable(rules.call_key) and callable(rules.inventory_key)
    assert rules.call_key("some-model", None) is not None  # a plain name is valid on every kind
    assert rules.call_key("", None) is None  # an empty one on none
    assert rules.inventory_key("some-model") is not None
    assert rules.refusal_types and all(isinstance(code, RefusalCode) for code in rules.refusal_types)
    assert isinstance(rules.refusal_404, bool)
    assert rules.no_model_prefix is None or rules.no_model_prefix
    assert all(isinstance(c, Capability) for c in rules.capabilities)
    assert issubclass(LINKS[kind], Link)
    assert kind in OPENAI.kinds  # every kind is served through the OpenAI facade at least


def test_the_registry_holds_the_kinds_and_nothing_else():
    assert set(KINDS) == set(BoxKind) == set(LINKS)


def test_a_cancel_goes_with_the_call_id_it_names():
    for rules in KINDS.values():
        assert (Capability.CANCEL in rules.capabilities) <= (Capability.CALL_ID in rules.capabilities)


def test_the_mounts_serve_only_registered_kinds():
    for facade in (mounts.OPENAI_OVER_OLLAMA, mounts.OPENAI_OVER_LMSTUDIO, OPENAI):
        assert facade.kinds <= set(KINDS)
