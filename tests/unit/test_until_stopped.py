"""A follower's loop (`until_stopped`) stops between items once `stop` is set: also when
the items keep arriving without a pause (a follower behind the log), and while it waits
for one that does not come."""

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from tether.adapters.event_log import until_stopped


async def backlog(closed: list[bool]) -> AsyncGenerator[int, None]:
    """Items that are always ready: the next never waits."""
    try:
        n = 0
        while True:
            n += 1
            yield n
    finally:
        closed.append(True)


async def test_a_follower_behind_stops_after_the_item_in_hand():
    stop, closed, taken = asyncio.Event(), [], []
    async for item in until_stopped(backlog(closed), stop):
        taken.append(item)
        if item == 3:
            stop.set()  # as a SIGTERM arrives while the third item is being handled
        assert len(taken) < 100, "it went on after stop was set"
    assert taken == [1, 2, 3]
    assert closed == [True]


async def test_a_follower_waiting_for_an_item_stops_at_once():
    stop, closed = asyncio.Event(), []

    async def quiet() -> AsyncGenerator[int, None]:
        try:
            yield 1
            await asyncio.Event().wait()  # nothing more arrives
            yield 2
        finally:
            closed.append(True)

    taken, first = [], asyncio.Event()

    async def follow() -> None:
        async for item in until_stopped(quiet(), stop):
            taken.append(item)
            first.set()

    following = asyncio.create_task(follow())
    await first.wait()
    stop.set()
    await asyncio.wait_for(following, timeout=5)
    assert taken == [1] and closed == [True]


async def test_items_that_end_end_the_follower():
    async def two() -> AsyncGenerator[int, None]:
        yield 1
        yield 2

    assert [item async for item in until_stopped(two(), asyncio.Event())] == [1, 2]


async def test_a_follower_cancelled_while_it_waits_closes_its_items():
    closed, first = [], asyncio.Event()

    async def quiet() -> AsyncGenerator[int, None]:
        try:
            yield 1
            await asyncio.Event().wait()
        finally:
            closed.append(True)

    async def follow() -> None:
        async with aclosing(until_stopped(quiet(), asyncio.Event())) as items:
            async for _ in items:
                first.set()

    following = asyncio.create_task(follow())
    await first.wait()
    await asyncio.sleep(0)  # it waits for the second item
    following.cancel()
    results = await asyncio.gather(following, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError), results
    assert closed == [True]
