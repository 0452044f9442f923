"""Chat calls through the official `openai` client from a chosen loopback address, read for where
they landed (`X-Hugpy-Box`) and how their key placed them (`X-Router-Affinity`)."""

from __future__ import annotations

import httpx
import openai


def client(router, source: str = "127.0.0.1") -> openai.OpenAI:
    transport = httpx.HTTPTransport(local_address=source)
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(transport=transport, timeout=30))


def chat(api: openai.OpenAI, messages: list, headers: dict | None = None, **extra) -> tuple[str, str | None]:
    """(box, X-Router-Affinity) of one chat call."""
    raw = api.chat.completions.with_raw_response.create(model="tiny", messages=messages,
                                                        extra_headers=headers or {}, **extra)
    raw.parse()
    return raw.headers["x-hugpy-box"], raw.headers.get("x-router-affinity")


def first_message(n: int) -> dict:
    return {"role": "user", "content": f"conversation {n}: " + "here is my long document. " * 40}
