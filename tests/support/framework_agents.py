"""A Pydantic AI agent as a child, for services a test starts as processes (PYTHONPATH):
its scripted model and its tool say each call they get on the unix socket
FRAMEWORK_SOCKET names (`<pid> <call>`), and the model's second request waits there for
the test's word to go on."""

import asyncio
import os

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tether.integrations.pydantic_ai import child


async def _say(what: str, *, then_wait: bool = False) -> None:
    reader, writer = await asyncio.open_unix_connection(os.environ["FRAMEWORK_SOCKET"])
    try:
        writer.write(f"{os.getpid()} {what}\n".encode())
        await writer.drain()
        if then_wait:
            await reader.readexactly(1)  # the test's word
    finally:
        writer.close()


async def scripted(messages, info: AgentInfo) -> ModelResponse:
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart):
        await _say("answer", then_wait=True)
        return ModelResponse(parts=[TextPart(f"found: {last.content}")])
    await _say("look up")
    return ModelResponse(parts=[ToolCallPart("lookup", {"query": last.content})])


research = Agent(FunctionModel(scripted), name="KilledResearcher")


@research.tool
async def lookup(ctx, query: str) -> str:
    await _say("tool")
    return f"two sources on {query}"


KilledResearcher = child(research)
