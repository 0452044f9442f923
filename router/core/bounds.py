"""Sizes: how long an identifier a client may route by, and how much client text goes back out.

Rules:
1. An identifier the router routes by (a model name in whatever field the facade reads it
   from, a pin, a pool; from the body or a header) is at most MAX_IDENTIFIER_BYTES of UTF-8.
   A longer one is a 400 (`identifier_too_long`) whose message names the field and shows at
   most ECHO_CHARS of the value.
2. Text that goes back out (a refusal body, a route-log column) passes through `clip`: at
   most `limit` characters of the original, then a marker saying how many were cut. So what
   the router writes stays bounded whatever a client or a box sent.
3. A number an operator gives (a `router serve` flag, a boxes file's field) is checked against
   its range once, where it is read: `positive_int`, `non_negative_int`, `finite_seconds`,
   `size_bytes`. Each returns the value or raises ValueError with one line saying the range
   (the caller names the flag or field and shows the value: `invalid value '-1': must be ...`).
   NaN and infinities are never in a range, and every range has an upper end: what is accepted
   can be slept on, added to a clock, sent to Granian and written as JSON (orjson takes
   integers up to 64 bits) without an error later.
"""

from __future__ import annotations

import re

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

# Rule 3's upper ends. A count (queue places, connections, in-flight calls): far above what a
# process holds (a process has at most ~1 M descriptors) and far inside 64 bits.
MAX_COUNT = 1 << 30
# A duration: a week is longer than any wait, grace or timeout worth giving, and a deadline that
# far off is still a plain float on every clock.
MAX_SECONDS = 7 * 86400.0
# A size in bytes: 1 TiB, far above any request body.
MAX_BYTES = 1 << 40
SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
INTEGER_RE = re.compile(r"[+-]?[0-9]{1,24}")  # ASCII digits only; long enough for any range


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


def non_negative_int(value: str | int, high: int = MAX_COUNT) -> int:
    """A whole number from 0 to `high` (rule 3). Raises ValueError otherwise."""
    return _int_in(value, 0, high)


def positive_int(value: str | int, high: int = MAX_COUNT) -> int:
    """A whole number from 1 to `high` (rule 3). Raises ValueError otherwise."""
    return _int_in(value, 1, high)


def finite_seconds(value: str | float, *, zero_ok: bool = False, high: float = MAX_SECONDS) -> float:
    """A number of seconds, more than 0 (or 0 itself with `zero_ok`) and at most `high`
    (rule 3). Raises ValueError otherwise: NaN and infinities are never accepted."""
    seconds = _number(value)
    if not ((seconds >= 0 if zero_ok else seconds > 0) and seconds <= high):  # False for NaN
        low = "0 or more" if zero_ok else "more than 0"
        raise ValueError(f"must be a number of seconds, {low} and at most {high:g}")
    return seconds


def size_bytes(value: str) -> int:
    """A size such as `65536`, `64MiB`, `1.5g` (k, m, g, t: powers of 1024), from 1 byte to
    MAX_BYTES (rule 3). Raises ValueError otherwise."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    scale = SIZE_UNITS.get(text[-1:], 1)
    if scale != 1:
        text = text[:-1]
    try:
        size = float(text) * scale
    except ValueError:
        size = float("nan")
    if not 1 <= size <= MAX_BYTES:  # False for NaN
        raise ValueError("must be a size from 1 byte to 1TiB (such as 65536 or 64MiB)")
    return int(size)


def _int_in(value: str | int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        number = None  # JSON's true/false/1.5 are not counts
    elif isinstance(value, int):
        number = value
    else:
        text = value.strip()
        number = int(text) if INTEGER_RE.fullmatch(text) else None
    if number is None or not low <= number <= high:
        raise ValueError(f"must be a whole number from {low} to {high}")
    return number


def _number(value: str | float) -> float:
    if isinstance(value, bool):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")
