"""Two durable chat readers of one name, for the tests of a long handling."""

import asyncio
import contextlib

from eventually import eventually

ACK_WAIT_S = 0.6  # the readers' ack wait, for these tests (`chat_consumers.ACK_WAIT_S`)


async def held_while_the_other_waits(handling, waiting, renewals: list):
    """The first message of `handling`, held (being handled) while `waiting`, the other
    reader of the name, asks for one, until `renewals` counts six renewals (two ack
    waits): without them, `waiting` would have had the message by then. It must not."""
    async with asyncio.timeout(10):
        message = await anext(handling)
    other_got = asyncio.create_task(anext(waiting))
    try:
        await eventually(lambda: len(renewals) >= 6, timeout=20)
        assert not other_got.done(), other_got
    finally:
        other_got.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other_got
    return message
