"""An agent run streamed in the background keeps going when nobody holds its stream."""

import asyncio
import gc
import weakref

from tether.agents.in_process import AgentStream


async def test_a_stream_nobody_holds_runs_to_its_end() -> None:
    finished = asyncio.Event()
    awaited: list[weakref.ref] = []

    async def start(on_event) -> str:
        # Something only this run refers to, as a reply it waits for may be.
        reply = asyncio.get_running_loop().create_future()
        awaited.append(weakref.ref(reply))
        await reply
        finished.set()
        return "done"

    AgentStream(start)  # fire and forget
    await asyncio.sleep(0)  # one turn of the loop: the run starts and waits
    gc.collect()

    reply = awaited[0]()
    assert reply is not None, "the running task was collected"
    reply.set_result(None)
    await asyncio.wait_for(finished.wait(), timeout=1)
