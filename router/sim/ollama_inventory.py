"""The simulated Ollama server's inventory: the tags it has installed, the models it has
loaded, and the lists that report them (`/api/tags`, `/api/ps`, `/v1/models`;
contracts/ollama-lmstudio.md §1.2, §2).

Rules:
1. `tags` and `loaded` are the public state (the test thread may edit them); names meet under
   `fold_key` (Ollama's EqualFold), so `llama3` and `LLaMA3:latest` are one model. Lists show
   the shortest display form (`llama3:latest`) in the installed name's case.
2. Each name has a modified time (install order: the given order is newest first) and, once
   loaded, an expiry (`keep_alive` from its last call; reported, never enforced). Lists are
   newest first; `/v1/models` with nothing installed is `null` (Go's nil slice).
3. Loading a model afresh clears its prefix cache (a fresh runner has computed nothing).
4. Sizes and digests are plausible and stable per name, not measured.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from typing import Any

from router.sim.connection import Connection, Exchange
from router.sim.ollama_names import fold_key, parse
from router.sim.ollama_wire import DEFAULT_KEEP_ALIVE_S, rfc3339

MODEL_DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                 "parameter_size": "8.0B", "quantization_level": "Q4_K_M"}
CONTEXT_LENGTH = 4096


def display_name(name: str) -> str | None:
    """Ollama's `DisplayShortest` of `name` in the name's own case (None when invalid): the
    default host and namespace dropped, `:latest` added when there is no tag."""
    parsed = parse(name)
    return None if parsed is None else parsed.display_shortest()


def model_size(key: str) -> int:
    return 1_000_000_000 + zlib.crc32(key.encode()) % 4_000_000_000  # plausible, stable per name


def model_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def namespace(name: str) -> str:
    """Who owns a model in `/v1/models` (`owned_by`): its namespace, `library` by default."""
    parts = name.rsplit(":", 1)[0].split("/")
    return parts[-2] if len(parts) >= 2 else "library"


class Inventory:
    """Mixed into SimOllama: its tags, loaded models and their lists."""

    def _installed_names(self) -> list[str]:
        """Display names of `tags`, one per normalised name; stamps names new to the box."""
        names: dict[str, str] = {}
        for tag in list(self.tags):
            key = fold_key(tag)
            if key is not None and key not in names:
                names[key] = display_name(tag)
                self._modified.setdefault(key, time.time())
        return list(names.values())

    def _installed(self, key: str) -> str | None:
        return next((n for n in self._installed_names() if fold_key(n) == key), None)

    def _install(self, name: str) -> None:
        key = fold_key(name)
        if self._installed(key) is None:
            self.tags.append(name)
        self._modified[key] = time.time()

    def _uninstall(self, key: str) -> None:
        self.tags[:] = [t for t in self.tags if fold_key(t) != key]
        self._unload(key)

    def _load(self, name: str, key: str, keep_alive: float) -> None:
        if not any(fold_key(n) == key for n in list(self.loaded)):
            self.loaded.append(name)
            self.prefix_cache.forget(key)  # a fresh runner has computed nothing
        self._expires[key] = time.time() + keep_alive

    def _unload(self, key: str) -> None:
        self.loaded[:] = [n for n in self.loaded if fold_key(n) != key]
        self._expires.pop(key, None)

    # -- lists (rule 2) ---------------------------------------------------------------------

    def _tags(self, conn: Connection, ex: Exchange) -> None:
        rows = [self._tag_row(name) for name in self._installed_names()]
        rows.sort(key=lambda row: self._modified[fold_key(row["name"])], reverse=True)
        self._json(conn, ex, {"models": rows})

    def _ps(self, conn: Connection, ex: Exchange) -> None:
        rows = []
        for loaded in list(self.loaded):
            key = fold_key(loaded)
            name = self._installed(key) or display_name(loaded)
            expires = self._expires.setdefault(key, time.time() + DEFAULT_KEEP_ALIVE_S)
            size = model_size(key)
            rows.append((expires, {"name": name, "model": name, "size": size, "digest": model_digest(key),
                                   "details": MODEL_DETAILS, "expires_at": rfc3339(expires),
                                   "size_vram": size, "context_length": CONTEXT_LENGTH}))
        rows.sort(key=lambda pair: pair[0], reverse=True)
        self._json(conn, ex, {"models": [row for _, row in rows]})

    def _v1_models(self, conn: Connection, ex: Exchange) -> None:
        data = [{"id": name, "object": "model", "created": int(self._modified[fold_key(name)]),
                 "owned_by": namespace(name)} for name in self._installed_names()]
        data.sort(key=lambda row: row["created"], reverse=True)
        self._json(conn, ex, {"object": "list", "data": data or None})  # Go's nil slice: null

    def _tag_row(self, name: str) -> dict[str, Any]:
        key = fold_key(name)
        return {"name": name, "model": name, "modified_at": rfc3339(self._modified[key]),
                "size": model_size(key), "digest": model_digest(key), "details": MODEL_DETAILS}


ROUTES = {
    ("GET", "/api/tags"): Inventory._tags,
    ("HEAD", "/api/tags"): Inventory._tags,
    ("GET", "/api/ps"): Inventory._ps,
    ("GET", "/v1/models"): Inventory._v1_models,
}
