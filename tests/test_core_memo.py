"""router.core.memo: a bounded memo read by subscript (its rules 1-3)."""

from __future__ import annotations

from router.core.kinds import CALL_KEYS, KINDS, call_key
from router.core.memo import Memo
from router.core.types import BoxKind


def test_a_key_is_computed_once_and_a_full_memo_starts_over():
    asked: list[int] = []

    def compute(key: int) -> int:
        asked.append(key)
        return key * 2

    memo = Memo(compute, 2)
    assert (memo[1], memo[1], memo[2]) == (2, 2, 4) and asked == [1, 2]
    assert memo[3] == 6 and dict(memo) == {3: 6}  # past `size`: started over
    assert memo[1] == 2 and asked == [1, 2, 3, 1]


def test_call_key_is_each_kinds_own_rule_remembered():
    for kind in BoxKind:
        for model in ("m", "m@b+a", "library/m:7b", "", "bad name!"):
            want = KINDS[kind].call_key(model, "s")
            assert call_key(kind, model, "s") == want
            assert CALL_KEYS[(kind, model, "s")] == want
