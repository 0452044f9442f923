"""Locust scenario for bench/overload.py: two tenants overloading a small fleet.

Not a test, never imported by the router (`import locust` monkey-patches with gevent).

Each user, in a closed loop at `OVERLOAD_RATE` calls per second (constant throughput), POSTs a
streamed chat call with its tenant's key and reads the stream to its end. The heavy tenant has
10 users for each light one. Every call's status and latency (ms, from the request to the
stream's end) are written as JSON to $OVERLOAD_OUT when the test stops.
"""

from __future__ import annotations

import json
import os
import time

from locust import FastHttpUser, constant_throughput, events, task

PATH = "/v1/chat/completions"
BODY = {"model": "llama3", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
RATE = float(os.environ.get("OVERLOAD_RATE", "2"))
SAMPLES: dict[str, list[tuple[int, float]]] = {"heavy": [], "light": []}


class Tenant(FastHttpUser):
    abstract = True
    tenant = ""
    wait_time = constant_throughput(RATE)
    network_timeout = 60.0

    @task
    def chat(self) -> None:
        key = os.environ[f"OVERLOAD_KEY_{self.tenant.upper()}"]
        t0 = time.perf_counter()
        with self.client.post(PATH, json=BODY, stream=True, catch_response=True, name=self.tenant,
                              headers={"Authorization": f"Bearer {key}"}) as resp:
            status = resp.status_code
            if status == 200:
                for _ in resp.iter_content(65536):
                    pass
            else:
                resp.failure(f"HTTP {status}")
        SAMPLES[self.tenant].append((status, (time.perf_counter() - t0) * 1000))


class HeavyTenant(Tenant):
    tenant = "heavy"
    weight = 10


class LightTenant(Tenant):
    tenant = "light"
    weight = 1


@events.test_stop.add_listener
def _dump(environment, **_kw) -> None:
    out = os.environ.get("OVERLOAD_OUT")
    if out:
        with open(out, "w") as handle:
            json.dump(SAMPLES, handle)
