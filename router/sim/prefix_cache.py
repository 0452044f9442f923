"""The prefix cache every simulated box keeps, so that tests and the bench can see what cache-aware
routing gains: a box reuses what it computed for a prompt's leading elements, and only on the box
that computed it (llama.cpp's slots, vLLM's prefix caching, Ollama's runner).

Rules:
1. Per box and model, the box remembers the last PROMPTS_PER_MODEL prompts it processed (LRU),
   each as its elements' hashes with their token counts. A prompt's cached tokens are those of
   its longest run of leading elements equal to one remembered prompt's, short of its last
   element: an engine always evaluates at least the prompt's end, which the sim rounds up to the
   last element, so a repeated call costs as before. With `repeat_costs_one` (the llama.cpp sim)
   a prompt remembered whole has all its tokens cached but one, as llama-server reports it
   (`cache_n` = prompt tokens - 1: tests/real/test_real_sim_llamacpp.py). The match is by whole
   elements, where an engine matches tokens: a prompt that shares only its template's first
   tokens counts none here.
2. Tokens: an element counts one token per TOKEN_BYTES bytes of its text (at least one). Only
   this box's own rule: the router never counts tokens this way.
3. Prefill costs `prefill_s_per_token` per uncached token, waited before the first token.
4. A model loaded again (a load, other settings) or a restart forgets its prompts (`forget`).
5. Elements are parsed from the body by the sim itself (messages, input items, a prompt string
   cut into TOKEN_BYTES * 64-byte blocks); nothing is logged or kept but the hashes.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Callable, Iterator, NamedTuple

# llama-server keeps a prompt per slot and older ones in host memory (`--cache-ram`), restored for
# a later prompt they begin; vLLM a block pool: a few dozen here
PROMPTS_PER_MODEL = 64
TOKEN_BYTES = 4  # about what a BPE tokenizer makes of English text
STRING_BLOCK_BYTES = TOKEN_BYTES * 64


class Prefill(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    seconds: float


NO_PROMPT = Prefill(0, 0, 0.0)


def elements_of(body: dict[str, Any]) -> list[str]:
    """The prompt's elements in a parsed body (rule 5): chat messages, Responses input items, or a
    prompt string's blocks."""
    for field in ("messages", "input", "prompt"):
        value = body.get(field)
        if isinstance(value, list):
            return [json.dumps(item, sort_keys=True) for item in value]
        if isinstance(value, str) and value:
            return [value[i:i + STRING_BLOCK_BYTES] for i in range(0, len(value), STRING_BLOCK_BYTES)]
    return []


def prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt tokens this sim counts for `body` (rule 2): what every kind reports it took."""
    return sum(max(1, len(text.encode()) // TOKEN_BYTES) for text in elements_of(body))


class PrefixCache:
    def __init__(self, prefill_s_per_token: float = 0.0, prompts_per_model: int = PROMPTS_PER_MODEL,
                 repeat_costs_one: bool = False) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.prompts_per_model = prompts_per_model
        self.repeat_costs_one = repeat_costs_one  # rule 1
        self._prompts: dict[str, OrderedDict[tuple[int, ...], None]] = {}
        # observations, for tests and the bench
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def take(self, model: str, elements: list[str]) -> Prefill:
        """Processes a prompt of `elements` for `model` (rules 1-3)."""
        if not elements:
            return NO_PROMPT
        hashes = tuple(hash(text) for text in elements)
        tokens = [max(1, len(text.encode()) // TOKEN_BYTES) for text in elements]
        remembered = self._prompts.setdefault(model, OrderedDict())
        best = 0
        for prompt in remembered:
            matched = 0
            for mine, theirs in zip(hashes, prompt):
                if mine != theirs:
                    break
                matched += 1
            best = max(best, matched)
        remembered[hashes] = None
        remembered.move_to_end(hashes)
        while len(remembered) > self.prompts_per_model:
            remembered.popitem(last=False)
        total = sum(tokens)
        if best == len(hashes) and self.repeat_costs_one:
            cached = total - 1
        else:
            cached = sum(tokens[:min(best, len(hashes) - 1)])
        self.prompt_tokens += total
        self.cached_tokens += cached
        return Prefill(total, cached, (total - cached) * self.prefill_s_per_token)

    def prefill(self, model: str, body: dict[str, Any], answer: Callable[[Prefill], Any]) -> Any:
        """Runs `answer(prefill)` for the prompt in `body` after its prefill time (rule 3): at once
        when there is none (a sim handler's plain answer), else as steps that wait first."""
        prefill = self.take(model, elements_of(body))
        if prefill.seconds <= 0:
            return answer(prefill)
        return self._after(prefill, answer)

    @staticmethod
    def _after(prefill: Prefill, answer: Callable[[Prefill], Any]) -> Iterator[Any]:
        yield prefill.seconds
        steps = answer(prefill)
        if steps is not None:
            yield from steps

    def forget(self, model: str | None = None) -> None:
        """Rule 4: `model`'s prompts, or every model's."""
        if model is None:
            self._prompts.clear()
        else:
            self._prompts.pop(model, None)
