"""Which facade owns a path, per listener.

Main port: `/v1/*` (and `/health`) the OpenAI facade over every box kind; `/api/v0/*` and
`/api/v1/*` the LM Studio facade; every other `/api/*` and `/` the Ollama facade.
Dedicated engine ports (`--ollama-port`, `--lmstudio-port`): every path is that engine's, and
its `/v1/*` is the OpenAI facade over that engine's boxes only, as the real server's is.
The health listener (`--health-port`): `GET|HEAD /health` and nothing else.

A path no facade of a listener routes may still say where the client meant to go (app.py
answers it): `meant_under_v1`, a route of the listener's `/v1` whose base URL lacked the `/v1`;
`ollama_call`, an Ollama client's call that reached another API.
"""

from __future__ import annotations

from typing import Callable

from router.core.types import BoxKind
from router.facades import lmstudio, ollama, openai
from router.facades.table import Facade

Mount = Callable[[str], Facade]

OPENAI_OVER_OLLAMA = openai.FACADE.serving(frozenset({BoxKind.OLLAMA}), 502, "ollama-openai")
OPENAI_OVER_LMSTUDIO = openai.FACADE.serving(frozenset({BoxKind.LMSTUDIO}), 502, "lmstudio-openai")
HEALTH_ONLY = openai.FACADE.keeping(frozenset({"/health"}), "health")


def main(path: str) -> Facade:
    if path.startswith("/v1/") or path == "/health":
        return openai.FACADE
    if path.startswith(("/api/v0/", "/api/v1/")):
        return lmstudio.FACADE
    if path.startswith("/api/") or path == "/":
        return ollama.FACADE
    return openai.FACADE


def ollama_port(path: str) -> Facade:
    return OPENAI_OVER_OLLAMA if path.startswith("/v1/") else ollama.FACADE


def lmstudio_port(path: str) -> Facade:
    return OPENAI_OVER_LMSTUDIO if path.startswith("/v1/") else lmstudio.FACADE


def health_port(path: str) -> Facade:
    return HEALTH_ONLY


def meant_under_v1(mount: Mount, path: str) -> str | None:
    """`/v1` + `path` when that is a path of this listener (by any method): an OpenAI client whose
    base URL lacks its `/v1` (`POST /chat/completions`). None otherwise."""
    if path.startswith("/v1/") or path == "/v1":
        return None
    under = "/v1" + path
    return under if mount(under).route("GET", under)[1] else None


def ollama_call(facade: Facade, method: str, path: str) -> bool:
    """An Ollama client's call on a facade that is not Ollama's: a path of Ollama's API (`/api/chat`
    on the LM Studio listener), also under `/v1` (an OpenAI base URL given to an Ollama client)."""
    if facade is ollama.FACADE:
        return False
    bare = path[3:] if path.startswith("/v1/api/") else path
    return bare.startswith("/api/") and ollama.FACADE.route(method, bare)[1]
