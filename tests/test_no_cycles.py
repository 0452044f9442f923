"""An ended call leaves no cyclic garbage: reference counting frees all of it at once.

Why it matters: what only the cycle collector can free, it must first find, and its passes run
on the event loop. When every call left its objects in cycles (the call and its pieces, an
exchange and its head future, a closed box connection and its transport), the passes cost the
loop ~44 µs a call (bench/callpath_cpu.py, timing the collector with gc.callbacks); without
them ~13 µs. The router's app is driven here as bench/callpath_cpu.py drives it: called as an
ASGI app by an in-process client, in front of a simulated hugpy box in a process of its own,
in a fresh interpreter of its own (this file run as a script), so that nothing another test left
behind in pytest's process is collected inside the measured window.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from callpath_cpu import (  # noqa: E402
    ALIAS, ALIAS_CHAIN, BODY, STREAM_BODY, one_call, routable, scope, start_router, start_sim,
)

from router.boxes import aliases as box_aliases  # noqa: E402
from router.boxes import config as boxes_config  # noqa: E402

CALLS = 50


ALIAS_BODY = BODY.replace(b'"tiny-llama"', b'"%s"' % ALIAS.encode())


BODIES = {"non-stream": BODY, "stream": STREAM_BODY, "alias": ALIAS_BODY}


def cyclic_garbage(body: bytes, tmp_path: Path) -> list[str]:
    """The type names of what CALLS calls left to the cycle collector."""
    boxes_file = tmp_path / "boxes.json"
    sim = start_sim(boxes_file, 1)
    boxes_config.edit(boxes_file, lambda file: box_aliases.set_alias(file, ALIAS, ALIAS_CHAIN))

    async def main() -> list:
        router, stop = await start_router(boxes_file, tmp_path)
        try:
            await routable(router, body)
            for _ in range(5):  # pools and caches filled
                assert await one_call(router, scope(0), body) == 200
            # the router's first GPU scan is over (a worker thread's: on a host without NVML,
            # pynvml's failed first load leaves a few ctypes classes in cycles, once a process)
            await asyncio.sleep(1.5)
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(CALLS):
                    assert await one_call(router, scope(0), body) == 200
                await asyncio.sleep(0.1)  # the route-log writer has taken the rows
                gc.collect()
                return [type(o).__name__ for o in gc.garbage]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        finally:
            await stop()

    try:
        return uvloop.run(main())
    finally:
        sim.terminate()
        sim.wait(10)


@pytest.mark.parametrize("kind", list(BODIES))
def test_an_ended_call_leaves_no_cyclic_garbage(tmp_path, kind):
    done = subprocess.run([sys.executable, __file__, kind, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


if __name__ == "__main__":
    print(json.dumps(cyclic_garbage(BODIES[sys.argv[1]], Path(sys.argv[2]))))
