"""The same agent in each framework (Pydantic AI, the OpenAI Agents SDK, LangGraph) as a
child, for services a test starts as processes (PYTHONPATH): its scripted model and its
tool say each call they get on the unix socket FRAMEWORK_SOCKET names (`<pid> <call>`),
and the model's second request waits there for the test's word to go on. Each looks the
prompt up with a tool, then answers `found: <what the tool said>`."""

import asyncio
import json
import os
from typing import Any

from agents import Agent as SdkAgent
from agents import Model, ModelResponse, Usage, function_tool, set_tracing_disabled
from langchain_core.messages import AIMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse as PydanticResponse
from pydantic_ai.messages import TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tether.integrations import langgraph, openai_agents, pydantic_ai

set_tracing_disabled(True)


async def _say(what: str, *, then_wait: bool = False) -> None:
    reader, writer = await asyncio.open_unix_connection(os.environ["FRAMEWORK_SOCKET"])
    try:
        writer.write(f"{os.getpid()} {what}\n".encode())
        await writer.drain()
        if then_wait:
            await reader.readexactly(1)  # the test's word
    finally:
        writer.close()


async def _look_up(query: str) -> str:
    await _say("tool")
    return f"two sources on {query}"


# --- Pydantic AI: a FunctionModel and a tool -------------------------------------------

async def scripted(messages, info: AgentInfo) -> PydanticResponse:
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart):
        await _say("answer", then_wait=True)
        return PydanticResponse(parts=[TextPart(f"found: {last.content}")])
    await _say("look up")
    return PydanticResponse(parts=[ToolCallPart("lookup", {"query": last.content})])


research = Agent(FunctionModel(scripted), name="KilledResearcher")


@research.tool
async def lookup(ctx, query: str) -> str:
    return await _look_up(query)


KilledResearcher = pydantic_ai.child(research)


# --- the OpenAI Agents SDK: a Model that follows the script, and a function tool --------

def sdk_looking_up(input: list) -> ModelResponse:
    """The script's answer to `input`: a call of `sdk_lookup` with the prompt, then, given
    the tool's output, `found: <output>`."""
    outputs = [item["output"] for item in input
               if isinstance(item, dict) and item.get("type") == "function_call_output"]
    output: list = [ResponseOutputMessage(
        type="message", id="msg-1", role="assistant", status="completed",
        content=[ResponseOutputText(type="output_text", text=f"found: {outputs[-1]}",
                                    annotations=[])])] if outputs else [
        ResponseFunctionToolCall(
            type="function_call", id="fc-1", call_id="look-1", name="sdk_lookup",
            arguments=json.dumps({"query": input[-1]["content"]}), status="completed")]
    return ModelResponse(output=output, usage=Usage(requests=1, input_tokens=10,
                                                    output_tokens=1, total_tokens=11),
                         response_id=None)


class SdkScript(Model):
    async def get_response(self, system_instructions, input, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        if any(isinstance(item, dict) and item.get("type") == "function_call_output"
               for item in input):
            await _say("answer", then_wait=True)
        else:
            await _say("look up")
        return sdk_looking_up(input)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError


@function_tool
async def sdk_lookup(query: str) -> str:
    """Looks a query up."""
    return await _look_up(query)


KilledSdkResearcher = openai_agents.child(
    SdkAgent(name="KilledSdkResearcher", model=SdkScript(), tools=[sdk_lookup]))


# --- LangGraph: a graph whose nodes are the model's two turns and the tool between -------

async def ask(state: MessagesState) -> dict:
    await _say("look up")
    return {"messages": [AIMessage("", tool_calls=[{
        "name": "lookup", "args": {"query": state["messages"][-1].content}, "id": "look-1",
        "type": "tool_call"}])]}


async def call_tool(state: MessagesState) -> dict:
    found = await _look_up(state["messages"][-1].tool_calls[0]["args"]["query"])
    return {"messages": [AIMessage(found)]}


async def answer(state: MessagesState) -> dict:
    await _say("answer", then_wait=True)
    return {"messages": [AIMessage(f"found: {state['messages'][-1].content}")]}


def _graph() -> Any:
    graph = StateGraph(MessagesState)
    for node in (ask, call_tool, answer):
        graph.add_node(node.__name__, node)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", "call_tool")
    graph.add_edge("call_tool", "answer")
    graph.add_edge("answer", END)
    return graph.compile()


KilledGraphResearcher = langgraph.child(_graph(), agent_type="KilledGraphResearcher")
