"""Alias edits, on the boxes file (router.boxes.config rules 5 and 6), and what the fleet serves.

Rules:
1. `set_alias` and `remove_alias` are changes for `router.boxes.config.edit`: locked, atomic,
   the same path for the CLI (`router aliases set|remove`) and the admin API
   (`PUT|DELETE /v1/aliases/<name>`). A definition that router.core.aliases.check_alias refuses
   raises ConfigError with its one line, and nothing is written.
2. `served_by` names the boxes whose inventory advertises a model under their kind's name rule
   (the decision's gate, without the call's pool or pin): the admin API refuses an alias that
   would shadow a served model (409). The CLI has no inventories: it asks the running router's
   admin API where it can (router.cli.aliases), else writes unchecked; the running router's
   listings flag a shadow (`shadowed_by`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from router.boxes.config import BoxesFile
from router.core.aliases import Alias, check_alias
from router.core.errors import ConfigError
from router.core.kinds import KINDS


class UnknownAlias(ConfigError):
    """No alias of that name in the file."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no alias named {name}")
        self.name = name


def _nothing_served(model: str) -> bool:
    return False


def set_alias(boxes: BoxesFile, name: str, chain: Sequence[str],
              served: Callable[[str], bool] = _nothing_served) -> bool:
    """Defines alias `name` as `chain` (rule 1); `served(model)` says whether a box serves a
    model of that name now. Returns True when the alias is new. Raises ConfigError."""
    wrong = check_alias(name, chain, boxes.aliases, served)
    if wrong is not None:
        raise ConfigError(wrong)
    added = name not in boxes.aliases
    boxes.aliases[name] = Alias(name, tuple(chain))
    return added


def remove_alias(boxes: BoxesFile, name: str) -> Alias:
    """Removes and returns alias `name`. Raises UnknownAlias."""
    try:
        return boxes.aliases.pop(name)
    except KeyError:
        raise UnknownAlias(name) from None


def served_by(boxes: Iterable, model: str) -> list[str]:
    """The names of `boxes` (router.boxes.state.BoxState) advertising `model` (rule 2)."""
    names = []
    for box in boxes:
        named = KINDS[box.config.kind].call_key(model, None)
        if named is not None and (named[0] in box.catalog or named[0] in box.residents):
            names.append(box.config.name)
    return names
