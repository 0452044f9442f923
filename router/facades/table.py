"""What a facade is: a table of routes onto the one proxy path, plus its error shape.

A model-bearing route names where its model is (`body`); a fleet route names the local answer
the router gives itself (`answer`). Adding an endpoint means adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

from router.core.types import BoxKind


class Body(IntEnum):
    JSON = 1  # model in the JSON body
    FORM = 2  # multipart form field `model`, or a JSON body


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    body: Body | None = None  # model-bearing: where the model is
    answer: str | None = None  # fleet route: the name of the router's own answer


@dataclass(frozen=True)
class Facade:
    name: str
    kinds: frozenset[BoxKind]
    routes: dict[tuple[str, str], Route]
    no_box_status: int
    # shape_error(status, code, message, extra) -> JSON body bytes in the facade's own shape
    shape_error: Callable[[int, str, str, dict | None], bytes]

    def route(self, method: str, path: str) -> tuple[Route | None, bool]:
        """(route, path known): a known path with another method is a 405, not a 404."""
        found = self.routes.get((method, path))
        if found is not None:
            return found, True
        return None, any(p == path for _, p in self.routes)


def table(*routes: Route) -> dict[tuple[str, str], Route]:
    return {(r.method, r.path): r for r in routes}
