"""A bounded memo read by subscript: `memo[key]` is `compute(key)`, worked out once per key.

Rules:
1. A key seen before costs one dict look-up and no Python frame: the call path reads memos
   several times a call (a call's key per box kind, the access gate's verdicts).
2. `compute` is pure: the same key always gives the same value, so a kept value is never stale.
3. At most `size` keys: a new key past that starts over, so a stream of distinct keys (names
   and addresses that clients choose) holds bounded memory.
"""

from __future__ import annotations

from typing import Callable, Hashable


class Memo(dict):
    __slots__ = ("compute", "size")

    def __init__(self, compute: Callable[[Hashable], object], size: int) -> None:
        super().__init__()
        self.compute = compute
        self.size = size

    def __missing__(self, key: Hashable) -> object:
        if len(self) >= self.size:
            self.clear()
        value = self[key] = self.compute(key)
        return value
