"""LoopWatch in one process: a task that blocks the loop is named, with the line that
blocks, and the time it blocked is told once the loop runs again."""

import asyncio
import time

from tether.loop_watch import LoopWatch, child_task_name


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def blocking_child() -> None:
    time.sleep(0.4)  # the blocking call


async def test_a_blocking_child_is_named_with_its_line_and_how_long_it_blocked():
    lines = Lines()
    watch = LoopWatch(asyncio.get_running_loop(), lines, warn_after_s=0.1, beat_s=0.02)
    watch.start()
    try:
        async def child() -> None:
            blocking_child()

        await asyncio.create_task(child(), name=child_task_name("Researcher", "r-1"))
        await asyncio.sleep(0.1)  # a beat or two of the loop after the block
    finally:
        watch.stop()

    (blocked_event, blocked), (unblocked_event, unblocked) = lines.lines
    assert (blocked_event, unblocked_event) == ("event_loop.blocked", "event_loop.unblocked")
    assert (blocked["agent_type"], blocked["run_id"]) == ("Researcher", "r-1")
    line = blocking_child.__code__.co_firstlineno + 1
    assert blocked["where"] == f"{__file__}:{line} in blocking_child"
    assert 350 <= unblocked["blocked_ms"] < 1_000


async def test_a_loop_that_keeps_running_is_not_reported():
    lines = Lines()
    watch = LoopWatch(asyncio.get_running_loop(), lines, warn_after_s=0.1, beat_s=0.02)
    watch.start()
    try:
        for _ in range(10):
            await asyncio.sleep(0.02)
    finally:
        watch.stop()
    assert lines.lines == []
