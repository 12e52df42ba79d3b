"""A service command's event loop ends whatever its coroutine left running: a task that
ignores its cancellation (an abandoned connect) is waited for a bounded time, not for
ever (`tether.cli.end_remaining`)."""

import asyncio

from tether.cli import _in_loop, end_remaining
from tether.config import Settings


def test_a_task_that_ignores_its_cancellation_is_left_behind_after_the_wait() -> None:
    loop = asyncio.new_event_loop()
    cancelled = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append("ignored")

    async def polite() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.append("cleaned up")

    try:
        left = loop.create_task(stubborn())
        ended = loop.create_task(polite())
        loop.run_until_complete(asyncio.sleep(0))  # both started
        end_remaining(loop, within_s=0.05)
        assert sorted(cancelled) == ["cleaned up", "ignored"]
        assert ended.cancelled() and not left.done()
    finally:
        loop.close()


def test_a_command_returns_its_coroutines_answer_on_either_loop() -> None:
    async def main() -> int:
        asyncio.get_running_loop().create_task(asyncio.sleep(3600))  # left running
        return 7

    for choice in ("asyncio", "uvloop"):
        assert _in_loop(Settings(event_loop=choice), main()) == 7
