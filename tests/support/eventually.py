"""Waiting for what no event announces: a condition polled until it holds, or a deadline.

For what a test can only observe by asking (a projection's checkpoint, a metric, a
consumer's counts, a list another task appends to). Whatever an event announces (a
message, a run's next event, a condition variable) is awaited instead.
"""

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(probe: Callable[[], T | Awaitable[T]], *, timeout: float = 10.0,
                     interval: float = 0.05) -> T:
    """The first truthy value of `probe` (a function, or a coroutine function), called
    every `interval` seconds; after `timeout` seconds (a probe still running is cancelled
    too), AssertionError with the last value it returned."""
    last: object = None
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            while True:
                value = probe()
                if inspect.isawaitable(value):
                    value = await value
                last = value
                if value:
                    return value  # type: ignore[return-value]
                await asyncio.sleep(interval)
    except TimeoutError:
        if not deadline.expired():
            raise  # the probe's own
        raise AssertionError(f"not within {timeout:g}s; the probe last returned {last!r}") from None
