"""A call's place in the wait queue (router/serve/admission.py: Seat), driven directly: what a
call's end does to its place, whatever the end."""

from __future__ import annotations

import asyncio
import types

import uvloop

from router.core.lifecycle import Event, Lifecycle, Phase
from router.core.admission import Priority
from router.core.types import Decision, Path, Reason, ReasonCode
from router.facades.openai import FACADE
from router.serve.admission import Admission, Seat
from router.serve.record import CallRecord
from router.serve.reply import Reply

FULL = Decision(Path.REFUSED, (), {}, {"b": Reason(ReasonCode.FULL)})


class Box:
    name = "b"
    full = False


def seat_for(admission: Admission) -> tuple[Seat, Lifecycle]:
    route, _ = FACADE.route("POST", "/v1/chat/completions")
    life = Lifecycle()
    record = CallRecord("call-1", FACADE, route, types.SimpleNamespace(caller="127.0.0.1"), life)
    reply = Reply(types.SimpleNamespace(), FACADE, record, on_left=lambda: None)
    life.fire(Event.BODY_IN)
    load = types.SimpleNamespace(count_on=lambda box: None)
    return Seat(admission, reply, life, load, lambda facts: Decision(Path.RANKED, ("b",), {}, {})), life


def test_a_waiting_call_whose_task_is_cancelled_leaves_the_queue_and_is_never_handed_a_slot():
    """The server stops while a call waits: its task is cancelled, which cancels the future it
    awaits too. It must leave the queue then; if it stayed, the next freed slot would go to a
    call that has ended (the hand-out would fail inside whichever call freed the slot)."""
    box = Box()
    fleet = types.SimpleNamespace(ordered=lambda: [box], facts=lambda: [], get=lambda name: box)
    admission = Admission(fleet, capacity=4, timeout_s=60)

    async def main() -> None:
        seat, life = seat_for(admission)
        assert await seat.join(FULL, "127.0.0.1", Priority.NORMAL)
        assert len(admission.queue) == 1 and life.phase is Phase.QUEUED
        waiting = asyncio.get_running_loop().create_task(seat.wait(FULL))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(admission.queue) == 0
        assert admission.outcomes["left"] == 1
        life.fire(Event.DONE)
        admission.freed(box)  # a slot frees: nobody is waiting for it
        assert admission.outcomes["admitted"] == 0

    uvloop.run(main())
