"""`resilience.Persisting`: a write's attempts, retried across transient errors by the
caller's own loop."""

import asyncio

import pytest
from recorded_log import RecordedLog

from tether.resilience import Persisting


async def written(failures: list[BaseException], **options: object) -> tuple[str, int]:
    """Write once after `failures` are raised, one per attempt; the result and the attempts."""
    tries = 0
    async for attempt in Persisting("test.write", **options):  # type: ignore[arg-type]
        with attempt:
            tries += 1
            if failures:
                raise failures.pop(0)
            result = "written"
    return result, tries


async def test_a_first_attempt_that_succeeds_says_nothing_and_starts_nothing() -> None:
    log, kept = RecordedLog(), []

    async def keep() -> None:
        kept.append("kept")

    assert await written([], logger=lambda: log, while_retrying=keep) == ("written", 1)
    assert log.lines == [] and kept == []


async def test_transient_errors_are_retried_until_the_write_lands_and_said_once_each_way() -> None:
    log = RecordedLog()
    assert await written([TimeoutError(), ConnectionError("reset")],
                         logger=lambda: log) == ("written", 3)
    assert [(event, fields["loop"]) for event, fields in log.lines] == [
        ("dependency.lost", "test.write"), ("dependency.restored", "test.write")]
    assert log.lines[0][1]["error"] == "TimeoutError"


async def test_an_error_that_is_not_transient_ends_the_attempts_at_once() -> None:
    with pytest.raises(ValueError, match="bad input"):
        await written([ValueError("bad input")], logger=RecordedLog)


async def test_also_makes_more_errors_transient_here() -> None:
    log = RecordedLog()
    assert await written([KeyError("gone")], logger=lambda: log, also=(KeyError,)) == (
        "written", 2)
    # Retried as a dependency's error, it is said as one (not as the loop's own failure).
    assert [event for event, _ in log.lines] == ["dependency.lost", "dependency.restored"]


async def test_give_up_set_raises_the_last_error_and_stops_what_ran_while_retrying() -> None:
    give_up, keeping = asyncio.Event(), asyncio.Event()
    side: list[asyncio.Task] = []

    async def keep() -> None:
        side.append(asyncio.current_task())  # type: ignore[arg-type]
        keeping.set()
        await asyncio.Event().wait()

    async def write() -> None:
        async for attempt in Persisting("test.write", RecordedLog, give_up=give_up,
                                        while_retrying=keep):
            with attempt:
                raise TimeoutError("broker away")

    writing = asyncio.create_task(write())
    await keeping.wait()  # the first failure started it
    give_up.set()
    with pytest.raises(TimeoutError, match="broker away"):
        await writing
    await asyncio.sleep(0)
    assert side[0].cancelled()


async def test_what_ran_while_retrying_is_stopped_once_the_write_lands() -> None:
    side: list[asyncio.Task] = []

    async def keep() -> None:
        side.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.Event().wait()

    assert await written([TimeoutError()], logger=RecordedLog, while_retrying=keep) == ("written", 2)
    await asyncio.sleep(0)
    assert side and side[0].cancelled()
