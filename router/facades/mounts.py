"""Which facade owns a path, per listener.

Main port: `/v1/*` (and `/health`) the OpenAI facade over every box kind; `/api/v0/*` and
`/api/v1/*` the LM Studio facade; every other `/api/*` and `/` the Ollama facade.
Dedicated engine ports (`--ollama-port`, `--lmstudio-port`): every path is that engine's, and
its `/v1/*` is the OpenAI facade over that engine's boxes only, as the real server's is.
"""

from __future__ import annotations

from typing import Callable

from router.core.types import BoxKind
from router.facades import lmstudio, ollama, openai
from router.facades.table import Facade

Mount = Callable[[str], Facade]

OPENAI_OVER_OLLAMA = openai.FACADE.serving(frozenset({BoxKind.OLLAMA}), 502, "ollama-openai")
OPENAI_OVER_LMSTUDIO = openai.FACADE.serving(frozenset({BoxKind.LMSTUDIO}), 502, "lmstudio-openai")


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
