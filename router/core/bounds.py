"""Sizes: how long an identifier a client may route by, and how much client text goes back out.

Rules:
1. An identifier the router routes by (a model name in whatever field the facade reads it
   from, a pin, a pool; from the body or a header) is at most MAX_IDENTIFIER_BYTES of UTF-8.
   A longer one is a 400 (`identifier_too_long`) whose message names the field and shows at
   most ECHO_CHARS of the value.
2. Text that goes back out (a refusal body, a route-log column) passes through `clip`: at
   most `limit` characters of the original, then a marker saying how many were cut. So what
   the router writes stays bounded whatever a client or a box sent.
"""

from __future__ import annotations

from router.core.errors import BadRequest

# Docker/OCI references, the longest names in the fleet (Ollama's `registry/namespace/model:tag`),
# are capped at 255 characters (distribution/reference NameTotalLengthMax); Hugging Face ids
# are at most 96 + 1 + 96. A hugpy `@options` suffix fits in what is left.
MAX_IDENTIFIER_BYTES = 256
# How much of a refused identifier the error shows: enough to recognise it.
ECHO_CHARS = 32
# A route-log text column or one reason in a refusal body: a few identifiers' worth.
TEXT_CHARS = 1024
CLIP_MARK = "…[+%d chars]"


def clip(text: str, limit: int = TEXT_CHARS) -> str:
    """`text` itself when it has at most `limit` characters, else its first `limit` and a marker."""
    if len(text) <= limit:
        return text
    return text[:limit] + CLIP_MARK % (len(text) - limit)


def check_identifier(field: str, value: str) -> str:
    """Returns `value` when it is at most MAX_IDENTIFIER_BYTES of UTF-8.

    Raises BadRequest (`identifier_too_long`) otherwise, never echoing the value in full.
    """
    # A character is at most 4 bytes: short values skip the encode.
    if len(value) * 4 > MAX_IDENTIFIER_BYTES:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_IDENTIFIER_BYTES:
            raise BadRequest(
                f"'{field}' is {size} bytes, over the limit of {MAX_IDENTIFIER_BYTES} "
                f"(it starts {clip(value, ECHO_CHARS)!r})",
                code="identifier_too_long",
            )
    return value
