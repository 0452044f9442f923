"""Ollama's model names, as the simulated Ollama server parses them: written after Ollama's own
code (contracts/ollama-lmstudio.md §2), step for step, and on purpose not shared with the
router's `router.core.names`, which the simulated server exists to test.

1. `modelref.ParseRef`: trim; an empty name is "model is required"; drop one source suffix
   (a last `:cloud` or `:local`, or a tag ending in `-cloud`); a second suffix behind the first
   is a conflict.
2. `ParseNameBare`: a tag only when the last `:` comes after the last `/`; then cut `/` from the
   right into model, namespace and host; a `scheme://` is cut off the host. A separator with
   nothing on one side makes that side `!MISSING!`, which no part rule accepts.
3. `Merge` with `registry.ollama.ai/library/_:latest`: absent parts take the defaults.
4. `isValidPart`: 1-80 bytes (host 1-350); the first byte a letter, digit or `_`; then letters,
   digits, `_`, `-`, `.` (not in a namespace), `:` (only in a host).
5. `DisplayShortest`: the default host and namespace (matched case-insensitively) are left out;
   the tag always shows. `EqualFold`: all four parts compared case-insensitively.
"""

from __future__ import annotations

from typing import NamedTuple

MISSING = "!MISSING!"  # Ollama's MissingPart
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
_SOURCES = ("cloud", "local")
_MAX_LEN = {"host": 350, "namespace": 80, "model": 80, "tag": 80}
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


class Name(NamedTuple):
    host: str
    namespace: str
    model: str
    tag: str

    def is_valid(self) -> bool:
        return all(_valid_part(kind, part) for kind, part in zip(self._fields, self))

    def display_shortest(self) -> str:
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"


def _source_base(raw: str) -> str | None:
    """parseSourceSuffix: the name without its source suffix, or None when it has none."""
    colon = raw.rfind(":")
    if colon < 0:
        return None
    suffix = raw[colon + 1:].strip()
    if suffix.lower() in _SOURCES:
        return raw[:colon]
    if "/" not in suffix and suffix.lower().endswith("-cloud"):
        return raw[: colon + 1] + suffix[: -len("-cloud")]
    return None


def parse_ref(raw: str) -> str | None:
    """modelref.ParseRef: the base name, or None for an empty name or conflicting sources."""
    raw = raw.strip()
    if not raw:
        return None
    base = _source_base(raw)
    if base is None:
        return raw
    return None if _source_base(base) is not None else base


def _cut_last(s: str, sep: str) -> tuple[str, str, bool]:
    """cutPromised: split at the last `sep`; an empty side becomes MISSING."""
    at = s.rfind(sep)
    if at < 0:
        return s, "", False
    return s[:at] or MISSING, s[at + 1:] or MISSING, True


def parse_name(s: str) -> Name:
    """ParseNameBare, then Merge with the defaults."""
    tag = host = namespace = ""
    if s.rfind(":") > s.rfind("/"):
        s, tag, _ = _cut_last(s, ":")
    rest, model, cut = _cut_last(s, "/")
    if not cut:
        model = s
    else:
        rest, namespace, cut = _cut_last(rest, "/")
        if not cut:
            namespace = rest
        else:
            scheme, sep, after = rest.partition("://")
            host = after if sep else scheme
    return Name(host or DEFAULT_HOST, namespace or DEFAULT_NAMESPACE, model, tag or DEFAULT_TAG)


def _valid_part(kind: str, part: str) -> bool:
    if not 1 <= len(part) <= _MAX_LEN[kind] or part[0] not in _WORD:
        return False
    for c in part[1:]:
        if c in _WORD or c == "-":
            continue
        if c == "." and kind != "namespace":
            continue
        if c == ":" and kind == "host":
            continue
        return False
    return True


def parse(raw: str) -> Name | None:
    """The name a model-bearing call names, or None where Ollama answers `invalid model name`
    (or, for an empty name, its own wording)."""
    base = parse_ref(raw)
    if base is None:
        return None
    name = parse_name(base)
    return name if name.is_valid() else None


def fold_key(raw: str) -> str | None:
    """A key under which names that Ollama's EqualFold calls equal meet: the shortest display
    form, lower-cased. None when the name is invalid."""
    name = parse(raw)
    return None if name is None else name.display_shortest().lower()
