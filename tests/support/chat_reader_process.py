"""A durable chat reader (of CHAT_PARENT, `agent/name`; durable `app`) as a process of its own, for
the tests that pause one: it takes one message, logs `test.chat_got` (with its id),
handles it until SIGUSR1, then asks for the next (which acknowledges the first, unless
its handling lapsed), logs `test.chat_done` and exits. Its connection comes from the
TETHER_* environment, its readers' ack wait from CHAT_ACK_WAIT_S; it logs JSON lines on
stderr."""

import asyncio
import os
import signal
from contextlib import aclosing, suppress

from tether.adapters import chat_consumers
from tether.client import connect
from tether.log import configure_logging, get_logger

DURABLE = "app"


async def main() -> None:
    configure_logging(fmt="json")
    chat_consumers.ACK_WAIT_S = float(os.environ["CHAT_ACK_WAIT_S"])
    agent, name = os.environ["CHAT_PARENT"].split("/")
    released = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, released.set)
    async with connect() as tether, \
            aclosing(tether.parent(agent, name).chat(durable=DURABLE)) as chat:
        message = await anext(chat)
        get_logger().info("test.chat_got", id=message.id)
        await released.wait()
        with suppress(TimeoutError):  # asking for the next is what acknowledges this one
            async with asyncio.timeout(chat_consumers.ACK_WAIT_S / 2):
                await anext(chat)
        get_logger().info("test.chat_done")


if __name__ == "__main__":
    asyncio.run(main())
