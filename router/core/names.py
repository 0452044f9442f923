"""Model names per box kind: how a client's string becomes a box's inventory key (each kind's
rule is named in its description, router.core.kinds).

Rules (one per kind; a call reaching a box uses that box's kind's rule):
1. hugpy: `base@options`. The key is the base before the first `@`, stripped. Options split on
   `+` or `,`, tokens are case-insensitive, so the settings are the lower-cased tokens, sorted
   and joined with `+` (`ctx-low+RAM-only` == `ram-only+ctx-low`); no tokens means default (None).
   The full string still goes to the box unchanged.
2. ollama: Ollama's own parse (contracts/ollama-lmstudio.md §2): trim, drop one `:cloud`/`:local`
   source or `-cloud` tag suffix (a second is a conflict), a tag only after the last `/`, split
   model, namespace and host from the right, any `scheme://` cut off the host part only (a
   name without a host keeps it, and fails), defaults `registry.ollama.ai`/`library`/`latest`,
   per-part validity; the key is the shortest display form, lower-cased (lookups are
   case-insensitive). Invalid → None.
3. lmstudio and openai: the id exactly as sent, byte for byte.
"""

from __future__ import annotations

import re

OLLAMA_DEFAULT_HOST = "registry.ollama.ai"
OLLAMA_DEFAULT_NAMESPACE = "library"
OLLAMA_DEFAULT_TAG = "latest"

# Ollama's isValidPart: first char alnum or `_`; `.` not in a namespace; `:` only in a host.
_PART_RE = {
    "host": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}"),
    "namespace": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}"),
    "model": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"),
    "tag": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"),
}


def hugpy_split(name: str) -> tuple[str, str | None]:
    """Returns (base key, normalised settings or None)."""
    if "@" not in name:  # the common case: no options, no parsing
        return name.strip(), None
    base, _, opts = name.strip().partition("@")
    tokens = sorted({t.strip().lower() for t in re.split(r"[+,]", opts) if t.strip()})
    return base.strip(), ("+".join(tokens) if tokens else None)


def _source_suffix(name: str) -> str | None:
    """The `:cloud`/`:local` source or `-cloud` tag suffix ending `name`, or None."""
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon <= slash:
        return None
    tag = name[colon + 1 :].lower()
    if tag in ("cloud", "local"):
        return name[colon:]
    return name[-len("-cloud") :] if tag.endswith("-cloud") else None


def _strip_source(name: str) -> str | None:
    """Ollama's ParseRef: drops one source suffix; a second one behind it is a conflict (None)."""
    suffix = _source_suffix(name)
    if suffix is None:
        return name
    stripped = name[: -len(suffix)]
    return None if _source_suffix(stripped) is not None else stripped


def ollama_key(name: str) -> str | None:
    """Returns the case-folded shortest display name, or None when Ollama would reject it."""
    s = _strip_source(name.strip())
    if s is None:
        return None
    tag = OLLAMA_DEFAULT_TAG
    if s.rfind(":") > s.rfind("/"):  # a tag only after the last `/`
        s, _, tag = s.rpartition(":")
    namespace, host = OLLAMA_DEFAULT_NAMESPACE, OLLAMA_DEFAULT_HOST
    rest, slash, model = s.rpartition("/")
    if slash:
        rest, slash, namespace = rest.rpartition("/")
        if slash:
            # What is left is the host, whatever it holds (a `/` in it fails the part rule);
            # Ollama cuts any `scheme://` off the host alone, never off a whole name, and a
            # scheme with nothing after it leaves the host empty: the default, as when absent.
            # An empty part before a `/` is missing, which no part rule accepts.
            host = (rest.split("://", 1)[-1] or OLLAMA_DEFAULT_HOST) if rest else ""
    for kind, value in (("host", host), ("namespace", namespace), ("model", model), ("tag", tag)):
        if not _PART_RE[kind].fullmatch(value):
            return None
    if host.lower() != OLLAMA_DEFAULT_HOST:
        shown = f"{host}/{namespace}/{model}:{tag}"
    elif namespace.lower() != OLLAMA_DEFAULT_NAMESPACE:
        shown = f"{namespace}/{model}:{tag}"
    else:
        shown = f"{model}:{tag}"
    return shown.lower()


def hugpy_call_key(model: str, body_settings: str | None) -> tuple[str, str | None] | None:
    """Rule 1: (base, settings) of a call's model on a hugpy box; None if it has no base."""
    base, settings = hugpy_split(model)
    return (base, settings) if base else None


def ollama_call_key(model: str, body_settings: str | None) -> tuple[str, str | None] | None:
    """Rule 2: (key, the body's runner options) on an ollama box; None if Ollama would refuse
    the name."""
    key = ollama_key(model)
    return None if key is None else (key, body_settings)


def exact_call_key(model: str, body_settings: str | None) -> tuple[str, str | None] | None:
    """Rule 3: the id exactly as sent, with no settings; None if empty."""
    return (model, None) if model else None


def exact_key(advertised: str) -> str | None:
    """Rule 3 for a box's own advertised name: as it is."""
    return advertised
