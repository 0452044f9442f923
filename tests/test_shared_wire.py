"""The call path's round trips to the shared server (fleetwide/wire.py rules 2-3), in this process
against a redis-server of the test's own: what is asked in one loop iteration goes out as one
round trip, in order; a script the server forgot is loaded again; an error reply fails only its
own command; a server that stops answering fails the round trip at its deadline and is found
again once it answers."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import uvloop

from router.fleetwide.wire import ROUND_TRIP_TIMEOUT_S, SharedDown, SharedServer

from support.several_routers import run

pytestmark = pytest.mark.timeout(30)


def test_commands_asked_in_one_loop_iteration_share_one_round_trip_in_order(redis_server):
    async def scenario(server: SharedServer):
        await server.call(None, "DEL", "n")
        before = server.round_trips
        asked = [server.call(None, "INCR", "n") for _ in range(50)] + [server.call(None, "GET", "n")]
        replies = await asyncio.gather(*asked)
        return replies, server.round_trips - before

    replies, round_trips = run(scenario, redis_server)
    assert replies == list(range(1, 51)) + [b"50"]
    assert round_trips == 1


def test_a_command_asked_later_rides_the_next_round_trip(redis_server):
    async def scenario(server: SharedServer):
        await server.call(None, "SET", "x", "0")
        before = server.round_trips
        lazy = server.later(None, "SET", "x", "1")
        await asyncio.sleep(0.05)
        waited = lazy.done()
        read = await server.call(None, "GET", "x")  # sent after the lazy one, in the same round trip
        return waited, await lazy, read, server.round_trips - before

    waited, lazy, read, round_trips = run(scenario, redis_server)
    assert (waited, lazy, read, round_trips) == (False, b"OK", b"1", 1)


def test_a_script_the_server_forgot_is_loaded_again(redis_server):
    async def scenario(server: SharedServer):
        script = server.script("return tonumber(ARGV[1]) * 2")
        first = await server.call(script, 0, 21)
        await server.call(None, "SCRIPT", "FLUSH")  # as a restarted server would have
        return first, await server.call(script, 0, 4)

    assert run(scenario, redis_server) == (42, 8)


def test_an_error_reply_fails_its_own_command_only(redis_server):
    async def scenario(server: SharedServer):
        await server.call(None, "SET", "text", "a")
        results = await asyncio.gather(server.call(None, "INCR", "text"), server.call(None, "GET", "text"),
                                       return_exceptions=True)
        return results, server.up or server.why_down == "not reached yet"

    (failed, read), not_marked_down = run(scenario, redis_server)
    assert isinstance(failed, SharedDown) and "not an integer" in str(failed)
    assert read == b"a"
    assert not_marked_down


def test_a_reply_handler_that_fails_fails_nothing_else(redis_server, caplog):
    """Rule 7: `send`'s handlers run as the replies are read; one that raises is logged, and the
    commands after it in the same round trip, and the connection, are not failed for it."""
    async def scenario(server: SharedServer):
        await server.call(None, "PING")
        taken: list = []

        def broken(reply: object) -> None:
            raise RuntimeError("a bug in a handler")

        server.send(broken, None, "SET", "y", "1")
        server.send(taken.append, None, "GET", "y")
        after = await server.call(None, "GET", "y")
        return taken, after, server.wire is not None and server.wire.open

    taken, after, still_open = run(scenario, redis_server)
    assert taken == [b"1"] and after == b"1" and still_open
    assert "a shared server reply's handler failed" in caplog.text


def test_a_server_that_stops_answering_fails_the_round_trip_at_its_deadline(redis_server):
    async def scenario(server: SharedServer):
        await server.call(None, "PING")
        server.came_up()
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(SharedDown):
                await server.call(None, "PING")
            waited = time.monotonic() - started
            down = not server.up
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        again = await server.call(None, "PING")  # a new connection: the frozen one is dropped
        return waited, down, again

    waited, down, again = run(scenario, redis_server)
    assert ROUND_TRIP_TIMEOUT_S * 0.9 <= waited < ROUND_TRIP_TIMEOUT_S + 0.5
    assert down
    assert again == b"PONG"



def test_the_server_may_be_named_by_its_unix_socket(redis_server):
    """fleetwide/wire.py rule 6: `unix://PATH?db=N` connects to the socket and selects the database."""
    import redis

    async def scenario(server: SharedServer):
        return await server.call(None, "SET", "over-the-socket", "1")

    async def main():
        server = SharedServer(f"unix://{redis_server.socket}?db=3")
        try:
            return await scenario(server)
        finally:
            await server.close()

    assert uvloop.run(main()) == b"OK"
    assert redis.Redis(port=redis_server.port, db=3).get("over-the-socket") == b"1"
