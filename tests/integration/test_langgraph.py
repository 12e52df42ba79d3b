"""Compiled LangGraph graphs as Tether children, and Tether children as their tools, with the
real framework and LangChain's own fake chat model, on real NATS and Postgres: the
checkpoints are steps of the run, so the runner that takes a run over goes on from the
last one and no finished node runs again; `interrupt()` pauses the run; the model's usage
is the run's; a tool node's Tether child is a nested run whose progress reaches the
graph's custom stream."""

import asyncio
import itertools
import json
import operator
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest
from eventually import eventually
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import interrupt
from pydantic import BaseModel
from runner_stack import Stack

from tether import ChildAgent, RunContext
from tether.client import connect
from tether.contract.messages import UsageView
from tether.integrations.langgraph import child, tether_tool

DEADLINE_S = 30


class Calls:
    def __init__(self) -> None:
        self.nodes: list[str] = []
        self.gate = asyncio.Event()


CALLS = Calls()


class ToolCallingFake(GenericFakeChatModel):
    """LangChain's fake chat model, scripted; tools are the script's business."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> "ToolCallingFake":
        return self


def model(*replies: AIMessage) -> ToolCallingFake:
    return ToolCallingFake(messages=iter(replies))


class Draft(TypedDict):
    topic: str
    log: Annotated[list[str], operator.add]


async def plan(state: Draft) -> dict:
    CALLS.nodes.append("plan")
    reply = await model(AIMessage("outline", usage_metadata={
        "input_tokens": 12, "output_tokens": 3, "total_tokens": 15})).ainvoke(state["topic"])
    return {"log": [f"plan: {reply.content}"]}


async def research(state: Draft) -> dict:
    CALLS.nodes.append("research")
    await CALLS.gate.wait()
    return {"log": ["research"]}


async def review(state: Draft) -> dict:
    CALLS.nodes.append("review")
    answer = interrupt({"question": "publish?", "draft": state["log"]})
    return {"log": [f"review: {answer}"]}


def drafting(*nodes) -> Any:
    graph = StateGraph(Draft)
    for node in nodes:
        graph.add_node(node.__name__, node)
    graph.add_edge(START, nodes[0].__name__)
    for before, after in itertools.pairwise(nodes):
        graph.add_edge(before.__name__, after.__name__)
    graph.add_edge(nodes[-1].__name__, END)
    return graph.compile()


class Said(BaseModel):
    prompt: str


class Echoer(ChildAgent):
    input_model = Said

    async def run(self, ctx: RunContext, input: Said) -> str:
        await ctx.report_progress(milestone="echoing", message="echoing")
        await CALLS.gate.wait()  # until the test saw its milestone, where it looks for it
        return f"echo {input.prompt}"


ECHO = tether_tool("Echoer", description="Echoes")


async def call_model(state: MessagesState) -> dict:
    CALLS.nodes.append("model")
    if (last := state["messages"][-1]).type == "tool":
        return {"messages": [AIMessage(f"it said {json.loads(last.content)['summary']}")]}
    return {"messages": [AIMessage("", tool_calls=[{
        "name": "Echoer", "args": {"prompt": "hi"}, "id": "call-1", "type": "tool_call"}])]}


def delegating() -> Any:
    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([ECHO]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


class TopicInput(BaseModel):
    topic: str
    log: list[str] = []


Drafter = child(drafting(plan, research), agent_type="Drafter", input_model=TopicInput)
Reviewer = child(drafting(plan, review), agent_type="Reviewer", input_model=TopicInput)
Delegator = child(delegating(), agent_type="GraphDelegator")


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether, [Drafter, Reviewer, Delegator, Echoer])
        await started.start_parent()
        try:
            yield started
        finally:
            CALLS.gate.set()
            await started.close()


async def test_a_run_keeps_its_checkpoints_and_its_model_usage_in_its_log(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Drafter", {"topic": "HTTP/3"}, run_id="plain"),
        DEADLINE_S)
    assert result.ok, result
    assert result.output["log"] == ["plan: outline", "research"]
    assert CALLS.nodes == ["plan", "research"]
    state = await stack.state("plain")
    kinds = [s["kind"] for _, s in sorted(state.steps.items())]
    assert kinds.count("model") == 1 and "checkpoint" in kinds and "writes" in kinds
    assert UsageView.of_steps(state.steps) == UsageView(input_tokens=12, output_tokens=3,
                                                        total_tokens=15, cost=None)


async def test_a_runner_that_stops_mid_run_leaves_the_next_to_go_on_from_the_last_checkpoint(
        stack):
    first = await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Drafter", {"topic": "gRPC"}, run_id="taken"))

    async def researching():
        return CALLS.nodes == ["plan", "research"]

    await eventually(researching, timeout=DEADLINE_S)
    await stack.stop_runner(first)
    await stack.start_runner()

    async def researching_again():
        return CALLS.nodes == ["plan", "research", "research"]

    await eventually(researching_again, timeout=DEADLINE_S)
    CALLS.gate.set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output["log"] == ["plan: outline", "research"], result
    assert (await stack.state("taken")).attempt == 2  # and plan ran once


async def test_an_interrupt_pauses_the_run_and_the_answer_resumes_the_graph(stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Reviewer", {"topic": "QUIC"}, run_id="review"))

    state = await stack.until_paused("review")
    [item] = state.paused.pending
    assert (item["tool_name"], item["reason"]) == ("Reviewer", "input")
    assert item["input"] == {"question": "publish?", "draft": ["plan: outline"]}
    await stack.parent.continue_run("review", human_input="LGTM")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output["log"] == ["plan: outline", "review: LGTM"], result
    assert CALLS.nodes == ["plan", "review", "review"]  # the node starts again on resume


async def test_cancelling_the_run_cancels_the_graph(stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Drafter", {"topic": "x"}, run_id="cancelled"))

    async def researching():
        return "research" in CALLS.nodes

    await eventually(researching, timeout=DEADLINE_S)
    await stack.parent.cancel("cancelled")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok and result.status == "aborted", result


async def test_a_tool_node_delegates_to_a_tether_child_whose_progress_reaches_the_stream(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("GraphDelegator", {"prompt": "echo hi"}, run_id="graph"),
        DEADLINE_S)
    CALLS.gate = asyncio.Event()
    assert result.ok and result.summary == "it said echo hi", result
    # Outside a Tether run: under the parent it is given, its events on the custom stream.
    tools = ToolNode([tether_tool("Echoer", description="Echoes", parent=stack.parent)])
    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    events = []
    async for _, chunk in graph.compile().astream({"messages": [("user", "echo hi")]},
                                                  stream_mode=["custom"]):
        events.append(chunk["tether"])
        if "echoing" in chunk["tether"].get("milestones", ()):
            CALLS.gate.set()  # the child's milestone reached the stream while it ran
    assert CALLS.gate.is_set()
    assert events[-1]["status"] == "completed" and events[-1]["summary"] == "echo hi"


async def fanning_out(state: MessagesState) -> dict:
    if state["messages"][-1].type == "tool":
        answers = [json.loads(m.content)["summary"] for m in state["messages"]
                   if m.type == "tool"]
        return {"messages": [AIMessage(" and ".join(sorted(answers)))]}
    return {"messages": [AIMessage("", tool_calls=[
        {"name": "Echoer", "args": {"prompt": word}, "id": f"call-{word}", "type": "tool_call"}
        for word in ("one", "two")])]}


async def test_a_graph_fans_out_two_children_at_once_and_sees_the_progress_of_each(stack):
    await stack.start_runner()
    graph = StateGraph(MessagesState)
    graph.add_node("model", fanning_out)
    graph.add_node("tools", ToolNode([tether_tool("Echoer", description="Echoes",
                                                  parent=stack.parent)]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    seen: dict[str, list[str]] = {}
    final = None
    async with asyncio.timeout(DEADLINE_S):  # one child after the other would wait forever
        async for mode, chunk in graph.compile().astream(
                {"messages": [("user", "fan out")]}, stream_mode=["custom", "values"]):
            if mode == "values":
                final = chunk
                continue
            event = chunk["tether"]
            seen.setdefault(event["run_id"], []).extend(event.get("milestones", ()))
            both = [run for run, milestones in seen.items() if "echoing" in milestones]
            if len(both) == 2:
                CALLS.gate.set()  # both children ran at once, and the stream showed each
    assert CALLS.gate.is_set()
    assert final["messages"][-1].content == "echo one and echo two"


async def test_a_detached_delegation_answers_with_the_runs_handle_and_the_run_goes_on(stack):
    await stack.start_runner()
    CALLS.gate.set()
    tool = tether_tool("Echoer", description="Echoes", parent=stack.parent, detached=True)
    call = {"name": "Echoer", "args": {"prompt": "later"}, "id": "call-later",
            "type": "tool_call"}
    config = {"configurable": {"thread_id": "thread-1"}}
    handle = json.loads((await tool.ainvoke(call, config)).content)
    assert handle["detached"] is True and handle["run_id"] == "langgraph-thread-1-call-later"
    # The same tool call again (a graph resumed from its checkpoint): the same run.
    again = json.loads((await tool.ainvoke(call, config)).content)
    assert again["run_id"] == handle["run_id"]
    # The same tool call id in another thread is another run.
    other = json.loads((await tool.ainvoke(call, {"configurable": {"thread_id": "2"}})).content)
    assert other["run_id"] == "langgraph-2-call-later"
    with pytest.raises(ValueError, match="ToolCall"):
        await tool.ainvoke({"prompt": "no tool call"})  # its id names the run

    async def completed():
        snapshot = await stack.parent.inspect(handle["run_id"])
        return snapshot is not None and snapshot.status == "completed" and snapshot

    assert (await eventually(completed, timeout=DEADLINE_S)).summary == "echo later"
