"""How the simulated Ollama server reads and writes what Go writes for Ollama
(contracts/ollama-lmstudio.md §1): the host guard, `keep_alive` durations, RFC 3339 times,
`%q` quoting, NDJSON lines, the final line's metrics and the `/v1` error wrapper.

Rules:
1. Host guard: Ollama's `allowedHostsMiddleware` for a server bound to loopback (§1.1): a
   loopback, private or unspecified IP, `localhost`, `*.localhost`, `*.local`, `*.internal`
   or this machine's name. Go's netip IsPrivate, not Python's (which also takes in
   documentation ranges).
2. `keep_alive` (§1.3): a number is seconds, a string a Go duration (`5m`, `1h30m`, `-1s`; a
   bare number in a string has no unit and is an error); absent is the 5 m default and a
   negative value is forever (Go's time.Duration max). Errors read as Go's binding words them.
3. Go writes JSON without spaces; NDJSON is one such object and `\n` per line; metrics are in
   nanoseconds and a zero one is left out (`omitempty`).
4. On `/v1` an error is `{"error": {"message", "type", "param": null, "code": null}}`, its
   type following the status unless a behaviour names one (`openai.NewError`).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from datetime import datetime, timezone
from typing import Any

from router.sim.prefix_cache import NO_PROMPT, Prefill
from router.sim.wire import PROMPT_TOKENS, compact_json

DEFAULT_KEEP_ALIVE_S = 300.0  # OLLAMA_KEEP_ALIVE's default, 5m
FOREVER_S = 2**63 / 1e9  # Go's time.Duration max: a negative keep_alive expires in ~292 years

# §1.1: Go's netip IsPrivate (Python's is_private also takes in documentation ranges).
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
_HOSTNAME = socket.gethostname().lower()  # Ollama also admits the machine's own name
_HOST_PORT_RE = re.compile(r"\[([^\]]*)\]:[^:]*|([^:]*):[^:]*")  # net.SplitHostPort's two shapes

# api.Duration: a string is a Go duration (`5m`, `1h30m`, `-1s`); a bare number has no unit.
_DURATION_RE = re.compile(r"[-+]?((\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h))+")
_DURATION_PART_RE = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def host_allowed(host_header: str) -> bool:
    """Ollama's `allowedHostsMiddleware` for a server bound to loopback (§1.1)."""
    match = _HOST_PORT_RE.fullmatch(host_header)
    host = host_header if match is None else match.group(1) if match.group(1) is not None else match.group(2)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and (addr.is_loopback or addr.is_unspecified or any(addr in n for n in _PRIVATE_NETS)):
        return True
    host = host.lower()
    return host in ("", "localhost", _HOSTNAME) or host.endswith(_LOCAL_SUFFIXES)


def keep_alive_s(value: Any) -> float:
    """`keep_alive` in seconds (§1.3): a number is seconds, a string a Go duration; absent is
    the 5 m default and a negative value is forever. Raises ValueError like Go's binding."""
    if value is None:
        return DEFAULT_KEEP_ALIVE_S
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value in ("0", "+0", "-0"):
        seconds = 0.0
    elif isinstance(value, str) and _DURATION_RE.fullmatch(value):
        seconds = sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART_RE.findall(value))
        seconds = -seconds if value.startswith("-") else seconds
    elif isinstance(value, str) and re.fullmatch(r"[-+]?[\d.]+", value):
        raise ValueError(f'time: missing unit in duration "{value}"')
    elif isinstance(value, str):
        raise ValueError(f'time: invalid duration "{value}"')
    else:
        raise ValueError(f"Unsupported type: '{type(value).__name__}'")
    return FOREVER_S if seconds < 0 else seconds


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def go_quote(text: str) -> str:
    """Go's `%q` for plain names (a JSON string literal is the same for them)."""
    return json.dumps(text, ensure_ascii=False)


def evaluated_tokens(prefill: Prefill) -> int:
    """Ollama counts only the prompt tokens it evaluated: a cached prefix is left out."""
    return prefill.prompt_tokens - prefill.cached_tokens if prefill.prompt_tokens else PROMPT_TOKENS


def metrics(eval_count: int, prefill: Prefill = NO_PROMPT) -> dict[str, int]:
    """The final line's metrics, in nanoseconds; zero values are left out (Go's omitempty)."""
    values = {"total_duration": 150_000_000 + eval_count * 10_000_000, "load_duration": 1_000_000,
              "prompt_eval_count": evaluated_tokens(prefill), "prompt_eval_duration": 20_000_000,
              "eval_count": eval_count, "eval_duration": eval_count * 10_000_000}
    return {k: v for k, v in values.items() if v}


def ndjson_line(obj: object) -> bytes:
    """One NDJSON line (rule 3)."""
    return compact_json(obj) + b"\n"


def openai_error(status: int, message: str, type: str | None = None) -> dict[str, Any]:
    """`openai.NewError`: the type follows the status unless a behaviour names one."""
    if type is None:
        type = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": type, "param": None, "code": None}}
