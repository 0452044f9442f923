"""Box answers are bounded, and a box's silence is timed only while the router waits for it
(issue 11, items 8 and 9): the upstream pool against raw asyncio servers on loopback that
break HTTP in the ways a broken or hostile box would, and the router in front of them."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from router.upstream.pool import Exchange, StreamIdle

pytestmark = pytest.mark.timeout(60)


# -- the stream idle deadline (item 9) ----------------------------------------------------------


def test_the_idle_deadline_runs_only_while_the_reader_waits_for_the_box():
    """A reader busy writing to a slow client (no waiter) is not a silent box; new bytes push
    the deadline on; silence while the reader waits fails the exchange."""

    async def main():
        loop = asyncio.get_running_loop()
        exchange = Exchange(None, loop, reused=False)  # type: ignore[arg-type]  # no socket: fed by hand
        exchange.arm_idle(1.0, StreamIdle("silent"))
        now = loop.time()
        exchange.expire(now + 5.0)  # the reader is elsewhere (writing): the clock restarts
        assert exchange.error is None
        exchange.waiter = loop.create_future()  # now it waits for the box
        exchange.expire(now + 5.9)
        assert exchange.error is None
        exchange._feed(b"data: 1\n\n")  # the box spoke
        exchange.expire(now + 6.5)
        exchange.expire(now + 7.4)
        assert exchange.error is None
        exchange.expire(now + 7.6)
        assert isinstance(exchange.error, StreamIdle)

    uvloop.run(main())
