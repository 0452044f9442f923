"""Aliases: a stable name clients ask for, and the ordered chain of models that answers it. Pure.

Rules:
1. An alias is a name and a chain of 1 to MAX_CHAIN models, each a model name as clients know it
   (it may carry settings, hugpy's `model@options`). A name follows the caps of model names
   (router.core.bounds rule 1: at most MAX_IDENTIFIER_BYTES of UTF-8), is visible text without
   spaces, and has no `@` (that would read as settings). `check_alias` returns the one line that
   says what is wrong with a definition, or None: a chain that names the alias itself or another
   alias (no chains of aliases, so no loops), a model twice, or a name a box serves (an alias
   never shadows a served model).
2. A call for an alias tries its chain in order; a call for a plain name never falls back, and a
   call that opts out (`fallback` False) reaches only the chain's first model (`reach`).
3. `resolve` is the step, next to router.core.lifecycle's `next_attempt`: given the chain, each
   model's decision over the facts now, the models already left and the current model's
   attempts, it returns the first model in chain order that can answer now, with its decision.
   A model is passed over (`Move`) when:
   - NO_OWNER: its decision ranks no box and waits for none (no owner online, none eligible);
   - REFUSED: every owner it may try refused before the first byte (its decision, with those
     boxes excluded, ranks none; or it tried `max_boxes` boxes; or its pinned box refused);
   - FULL: every owner is full (its decision only waits for room) and a later model has room;
   - CONTEXT_LENGTH: the box said the prompt is too long for the model's context (rule 5);
   - NOT_ALLOWED: the caller's key's `models` do not name it (the serve layer leaves it before
     the call's first decision: an alias never reaches a model its caller may not call).
   The serve layer keeps the models left for good (`left`: REFUSED, CONTEXT_LENGTH); a full
   model is never left for good: when every model in reach is full, the step returns one
   decision that waits for the boxes of all of them, so the call takes whichever frees first,
   and once one has room the step again takes the first model in chain order that has.
4. It never returns a model twice after leaving it, never skips a model whose decision ranks a
   box, and a pinned call's decisions rank only its pin (decide's rule 2): it stays pinned.
5. `context_exceeded` tells a box's "prompt longer than the context" 400 (OpenAI's
   `context_length_exceeded`, llama.cpp's "exceeds the available context size", vLLM's and
   Ollama's wordings) from any other 4xx, which goes back as the box sent it.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from router.core.bounds import MAX_IDENTIFIER_BYTES
from router.core.types import Decision, Path, Reason, WAIT_REASONS

# A chain is a short list of alternatives: past a few, each fallback is a slower, worse answer
# (LiteLLM's and Bifrost's examples stop at three); eight leaves room and bounds a call's work.
MAX_CHAIN = 8
# Visible text, no spaces, no `@` (settings) in an alias's own name.
_NAME_RE = re.compile(r"[^\s@\x00-\x1f\x7f]+")
_MODEL_RE = re.compile(r"[^\s\x00-\x1f\x7f]+")


class Move(str, Enum):
    """Why a call's chain moved past a model: the `reason` label of router_fallbacks_total."""

    NO_OWNER = "no_owner"
    REFUSED = "refused"
    FULL = "full"
    CONTEXT_LENGTH = "context_length"
    NOT_ALLOWED = "not_allowed"  # the caller's key may not call it: left before the first decision, never counted


class Alias(NamedTuple):
    name: str
    chain: tuple[str, ...]


class Resolved(NamedTuple):
    """The model the call goes to now (its `position` in the chain; when none can answer, the
    first full one, else the first model in reach), its `decision` (REFUSED, perhaps waiting,
    when none can answer), and the models passed over on the way with why (`passed`, in chain
    order)."""

    position: int
    decision: Decision
    passed: tuple[tuple[int, Move], ...]


def _size_ok(text: str) -> bool:
    return len(text.encode("utf-8", "surrogatepass")) <= MAX_IDENTIFIER_BYTES


def check_alias(name: object, chain: object, aliases: Mapping[str, Any], served: Callable[[str], bool]) -> str | None:
    """The one line saying what is wrong with defining alias `name` as `chain`, or None.

    `aliases` are the other aliases (by name; `name` itself may be among them: a redefinition);
    `served(model)` says whether a box serves a model of that name now.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or not _size_ok(name):
        return (f"alias name must be 1-{MAX_IDENTIFIER_BYTES} bytes of visible text without spaces or '@'"
                f" (got {str(name)[:32]!r})")
    if served(name):
        return f"alias {name}: a box serves a model of that name; an alias may not shadow it"
    if not isinstance(chain, (list, tuple)) or not 1 <= len(chain) <= MAX_CHAIN:
        return f"alias {name}: the chain must list 1 to {MAX_CHAIN} models"
    for model in chain:
        if not isinstance(model, str) or not _MODEL_RE.fullmatch(model) or not _size_ok(model):
            return f"alias {name}: {str(model)[:32]!r} is not a model name (1-{MAX_IDENTIFIER_BYTES} bytes, no spaces)"
        if model == name:
            return f"alias {name}: a chain may not name the alias itself"
        if model in aliases and model != name:
            return f"alias {name}: {model} is an alias; a chain lists models, not aliases"
    for other, other_chain in aliases.items():
        if other != name and name in _chain_of(other_chain):
            return f"alias {name}: alias {other} lists {name} as a model; an alias may not be in a chain"
    if len(set(chain)) != len(chain):
        return f"alias {name}: a model appears twice in the chain"
    return None


def _chain_of(alias: Any) -> Sequence[str]:
    return alias.chain if isinstance(alias, Alias) else alias


def reach(chain: Sequence[str], fallback: bool) -> int:
    """How many of the chain's models a call may reach (rule 2)."""
    return len(chain) if fallback else 1


def resolve(
    chain: Sequence[str],
    decide_model: Callable[[int], Decision],
    left: Mapping[int, Move],
    current: int,
    tried: Sequence[str],
    pin: str | None,
    max_boxes: int,
    fallback: bool = True,
) -> Resolved:
    """The step of rule 3. `decide_model(position)` is that model's decision over the facts now
    (the current model's with its `tried` boxes excluded, the others' fresh); `left` are the
    positions left for good; `current` is the model the call is on and `tried` the boxes that
    refused it there. Pure: the same inputs give the same answer.

    Returns a Resolved; never raises for a model that cannot answer (that is a REFUSED decision).
    """
    passed: list[tuple[int, Move]] = []
    waiting: list[tuple[int, Decision]] = []
    first: tuple[int, Decision] | None = None
    for position in range(reach(chain, fallback)):
        if position in left:
            if position == current:  # the serve layer left it just now (a context-length 400)
                passed.append((position, left[position]))
            continue
        decision = decide_model(position)
        if first is None:
            first = (position, decision)
        spent = position == current and tried and (pin is not None or len(tried) >= max_boxes)
        if spent or not (decision.boxes or decision.waits_for):
            passed.append((position, Move.REFUSED if position == current and tried else Move.NO_OWNER))
        elif decision.boxes:
            return Resolved(position, decision, tuple(passed))
        else:  # full: passed over only if a later model has room
            waiting.append((position, decision))
            passed.append((position, Move.FULL))
    kept = tuple(step for step in passed if step[1] is not Move.FULL)
    if waiting:  # the call waits on the first full model, for whichever frees first
        return Resolved(waiting[0][0], wait_for_any([decision for _, decision in waiting]), kept)
    if first is None:  # every model in reach is left for good
        return Resolved(current, Decision(Path.REFUSED, (), {}, {}), kept)
    return Resolved(first[0], first[1], kept)


def wait_for_any(decisions: Sequence[Decision]) -> Decision:
    """One REFUSED decision waiting for the boxes of every one of `decisions` (all full): a box
    keeps the first waiting reason any model gave it, else its first reason."""
    ruled_out: dict[str, Reason] = {}
    for decision in decisions:
        for box, reason in decision.ruled_out.items():
            kept = ruled_out.get(box)
            if kept is None or (kept.code not in WAIT_REASONS and reason.code in WAIT_REASONS):
                ruled_out[box] = reason
    return Decision(Path.REFUSED, (), {}, ruled_out)


# Rule 5: what boxes say when the prompt does not fit the model's context. OpenAI's `code`;
# llama.cpp's `exceed_context_size_error` type and its message; vLLM's "maximum context length";
# Ollama's and LM Studio's wordings. Matched case-insensitively in the error's message.
CONTEXT_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_CONTEXT_TEXT = re.compile(
    r"exceeds the available context size|maximum context length|context length exceeded"
    r"|context_length_exceeded|prompt is too long|exceeds the context (?:size|length|window)"
    r"|is longer than the model's context length",
    re.IGNORECASE,
)


def context_exceeded(status: int, body: Any) -> bool:
    """True when a 400 answer (`body` its parsed JSON) says the prompt is too long for the
    model's context (rule 5)."""
    if status != 400 or not isinstance(body, dict):
        return False
    error = body.get("error")
    if isinstance(error, str):
        return _CONTEXT_TEXT.search(error) is not None
    if not isinstance(error, dict):
        return False
    if error.get("code") in CONTEXT_CODES or error.get("type") in CONTEXT_CODES:
        return True
    message = error.get("message")
    return isinstance(message, str) and _CONTEXT_TEXT.search(message) is not None
