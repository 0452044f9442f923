"""The admin API's aliases (`GET /v1/aliases`, `PUT|DELETE /v1/aliases/<name>`): what they do;
admin.py reads the request and writes the answer.

Rules:
1. Every change is one registry edit (the boxes file's router.boxes.config.edit, or the
   database's: locked, atomic, the CLI's code path), off the loop; the fleet applies it before the answer, so the next call sees it.
2. `PUT` takes `{"chain": [model, ...]}` (201 added, 200 replaced); a definition that
   router.core.aliases.check_alias refuses is a 400 with its one line, one named like a model a
   box serves now a 409 `alias_shadows_model` (a key allowed that model must never be sent
   elsewhere by its name); either changes nothing. `DELETE` of an unknown alias is a 404.
3. A listed alias shows its chain, the first model in it that some box could serve now
   (`first_available`, null when none: the decision over every box kind, without pin or pool),
   the boxes that serve a model of the alias's own name (`shadowed_by`: set by a box added
   after the alias), and the models of its chain that no box lists now (`unlisted`: a typo, or
   a model not pulled yet). A `PUT`'s answer says `unlisted` too; the definition is kept all
   the same (a box may list the model later).
"""

from __future__ import annotations

import asyncio

from router.boxes import aliases as box_aliases
from router.boxes.fleet import Fleet
from router.core.decide import decide
from router.core.errors import ConfigError
from router.core.types import BoxKind, Call

ALIAS_BODY_MAX_BYTES = 64 * 1024
ALL_KINDS = frozenset(BoxKind)


class AliasRefused(Exception):
    """An alias request refused (rule 2): its status, stable code and one line."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def first_available(fleet: Fleet, chain: tuple[str, ...]) -> str | None:
    """Rule 3: the first model of `chain` that some box could serve now."""
    facts = fleet.facts()
    for model in chain:
        if decide(Call(model, ALL_KINDS), facts).boxes:
            return model
    return None


def unlisted(boxes: list, chain: tuple[str, ...]) -> list[str]:
    """Rule 3: the models of `chain` that none of `boxes` lists now."""
    return [model for model in chain if not box_aliases.served_by(boxes, model)]


def alias_views(fleet: Fleet) -> list[dict]:
    boxes = fleet.ordered()
    return [{"name": alias.name, "chain": list(alias.chain), "first_available": first_available(fleet, alias.chain),
             "shadowed_by": box_aliases.served_by(boxes, alias.name), "unlisted": unlisted(boxes, alias.chain)}
            for alias in fleet.aliases.values()]


async def _edit(fleet: Fleet, change) -> object:
    """Rule 1: what `change` returned. Raises AliasRefused."""
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, fleet.registry.edit, change)
    except box_aliases.UnknownAlias as exc:
        raise AliasRefused(404, "unknown_alias", str(exc)) from None
    except ConfigError as exc:
        raise AliasRefused(400, "invalid_alias", str(exc)) from None
    except OSError as exc:
        raise AliasRefused(503, "boxes_file_unwritable",
                           f"cannot write the {fleet.registry.where}: {exc.strerror or exc}") from None
    await fleet.reload()
    return result


async def edit(fleet: Fleet, name: str, doc: dict | None) -> tuple[int, dict]:
    """`PUT` (`doc`, the body) or `DELETE` (`doc` None) of alias `name`: (status, answer).
    Raises AliasRefused."""
    if doc is None:
        await _edit(fleet, lambda file: box_aliases.remove_alias(file, name))
        return 200, {"name": name, "removed": True}
    chain = doc.get("chain")
    if set(doc) != {"chain"} or not isinstance(chain, list):
        raise AliasRefused(400, "invalid_alias", 'the body must be {"chain": [model, ...]}')
    serving = box_aliases.served_by(fleet.ordered(), name)  # read on the loop
    if serving:
        raise AliasRefused(409, "alias_shadows_model", f"alias {name}: box {', '.join(serving)} serves a model of "
                           "that name; an alias may not shadow it")
    added = await _edit(fleet, lambda file: box_aliases.set_alias(file, name, chain))
    alias = fleet.aliases[name]
    return (201 if added else 200), {"name": name, "chain": list(alias.chain),
                                     "first_available": first_available(fleet, alias.chain),
                                     "unlisted": unlisted(fleet.ordered(), alias.chain)}
