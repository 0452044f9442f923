"""The admin API's aliases: `GET /v1/aliases`, `PUT /v1/aliases/<name>`, `DELETE /v1/aliases/<name>`.

Rules:
1. Every change is one boxes-file edit (router.boxes.config.edit: locked, atomic, the CLI's code
   path), off the loop; the fleet applies it before the answer, so the next call sees it.
2. `PUT` takes `{"chain": [model, ...]}` (201 added, 200 replaced); a definition that
   router.core.aliases.check_alias refuses, or one that would shadow a model a box serves now,
   is a 400 with its one line and changes nothing. `DELETE` of an unknown alias is a 404.
3. A listed alias shows its chain, the first model in it that some box could serve now
   (`first_available`, null when none: the decision over every box kind, without pin or pool),
   and the boxes that serve a model of the alias's own name (`shadowed_by`: set by a box added
   after the alias).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import unquote

from router.boxes import aliases as box_aliases
from router.boxes import config as boxes_config
from router.core.decide import decide
from router.core.errors import ConfigError
from router.core.types import BoxKind, Call

if TYPE_CHECKING:
    from router.boxes.fleet import Fleet
    from router.serve.app import RouterApp
    from router.serve.edge import Edge

ALIAS_BODY_MAX_BYTES = 64 * 1024
ALL_KINDS = frozenset(BoxKind)


def _admin():
    """The admin module's answer helpers (it imports this module for its routing table)."""
    from router.serve import admin

    return admin


def first_available(fleet: Fleet, chain: tuple[str, ...]) -> str | None:
    """Rule 3: the first model of `chain` that some box could serve now."""
    facts = fleet.facts()
    for model in chain:
        if decide(Call(model, ALL_KINDS), facts).boxes:
            return model
    return None


def alias_views(fleet: Fleet) -> list[dict]:
    boxes = fleet.ordered()
    return [{"name": alias.name, "chain": list(alias.chain), "first_available": first_available(fleet, alias.chain),
             "shadowed_by": box_aliases.served_by(boxes, alias.name)}
            for alias in fleet.aliases.values()]


async def list_aliases(app: RouterApp, edge: Edge) -> None:
    await _admin()._json(edge, 200, {"aliases": alias_views(app.shared.fleet)})


def _name(edge: Edge) -> str:
    return unquote(edge.path.removeprefix("/v1/aliases/"))


async def _edit(app: RouterApp, edge: Edge, change) -> tuple[bool, object]:
    """Rule 1: (done, what `change` returned); not done once a refusal was answered."""
    fleet = app.shared.fleet
    try:
        result = await asyncio.get_running_loop().run_in_executor(None, boxes_config.edit, fleet.path, change)
    except box_aliases.UnknownAlias as exc:
        await _admin()._error(app, edge, 404, "unknown_alias", str(exc))
        return False, None
    except ConfigError as exc:
        await _admin()._error(app, edge, 400, "invalid_alias", str(exc))
        return False, None
    except OSError as exc:
        await _admin()._error(app, edge, 503, "boxes_file_unwritable",
                           f"cannot write the boxes file {fleet.path}: {exc.strerror or exc}")
        return False, None
    await fleet.reload()
    return True, result


async def put_alias(app: RouterApp, edge: Edge) -> None:
    name = _name(edge)
    doc = await _admin()._json_object(app, edge, ALIAS_BODY_MAX_BYTES)
    if doc is None:
        return
    chain = doc.get("chain")
    if set(doc) != {"chain"} or not isinstance(chain, list):
        await _admin()._error(app, edge, 400, "invalid_alias", 'the body must be {"chain": [model, ...]}')
        return
    fleet = app.shared.fleet
    shadowed = frozenset([name] if box_aliases.served_by(fleet.ordered(), name) else [])  # read on the loop
    served = shadowed.__contains__
    done, added = await _edit(app, edge, lambda file: box_aliases.set_alias(file, name, chain, served))
    if not done:
        return
    alias = fleet.aliases[name]
    await _admin()._json(edge, 201 if added else 200, {"name": name, "chain": list(alias.chain),
                                                     "first_available": first_available(fleet, alias.chain)})


async def delete_alias(app: RouterApp, edge: Edge) -> None:
    name = _name(edge)
    done, _ = await _edit(app, edge, lambda file: box_aliases.remove_alias(file, name))
    if done:
        await _admin()._json(edge, 200, {"name": name, "removed": True})
