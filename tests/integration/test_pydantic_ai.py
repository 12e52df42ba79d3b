"""Pydantic AI agents as Tether children, and Tether children as their tools, with the
real framework and its own scripted model (`FunctionModel`), on real NATS and Postgres:
every model request and tool call is a step, replayed instead of made again by the runner
that takes a run over; approvals pause the run; usage is the run's and counts against the
calling agent's limits."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from eventually import eventually
from pydantic import BaseModel
from pydantic_ai import Agent, UsageLimits
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.usage import RequestUsage
from runner_stack import Stack

from tether import ChildAgent, RunContext
from tether.client import connect
from tether.contract.messages import UsageView
from tether.integrations.pydantic_ai import TetherRunEvent, child, tether_tool

DEADLINE_S = 30


class Calls:
    """What the scripted model and the tools were asked, and a gate the test opens."""

    def __init__(self) -> None:
        self.model: list[str] = []
        self.tools: list[str] = []
        self.gate = asyncio.Event()


CALLS = Calls()


def last_part(messages):
    return messages[-1].parts[-1]


async def researching(messages, info: AgentInfo) -> ModelResponse:
    """Looks the prompt up with its tool, then (once the gate opens) says what it found."""
    last = last_part(messages)
    usage = RequestUsage(input_tokens=10, output_tokens=5)
    if isinstance(last, ToolReturnPart):
        CALLS.model.append("answer")
        await CALLS.gate.wait()
        return ModelResponse(parts=[TextPart(f"found: {last.content}")], usage=usage,
                             model_name="scripted")
    CALLS.model.append("look up")
    return ModelResponse(parts=[ToolCallPart("lookup", {"query": last.content},
                                             tool_call_id="look-1")],
                         usage=usage, model_name="scripted")


research = Agent(FunctionModel(researching), name="PydResearcher")


@research.tool_plain
def lookup(query: str) -> str:
    CALLS.tools.append(query)
    return f"two sources on {query}"


async def publishing(messages, info: AgentInfo) -> ModelResponse:
    last = last_part(messages)
    CALLS.model.append("publish")
    if isinstance(last, ToolReturnPart):
        return ModelResponse(parts=[TextPart(f"done: {last.content}")])
    return ModelResponse(parts=[ToolCallPart("publish", {"text": "hello"},
                                             tool_call_id="pub-1")])


publisher = Agent(FunctionModel(publishing), name="PydPublisher")


@publisher.tool_plain(requires_approval=True)
def publish(text: str) -> str:
    CALLS.tools.append(text)
    return f"published {text}"


class Words(BaseModel):
    text: str


class Echoer(ChildAgent):
    """A plain Tether child the Pydantic AI parent delegates to: a milestone, then (once
    the test saw it) its answer."""

    input_model = Words

    async def run(self, ctx: RunContext, input: Any) -> str:
        await ctx.report_progress(milestone="echoing", message="echoing")
        await CALLS.gate.wait()
        return f"echo {input.text}"




async def delegating(messages, info: AgentInfo) -> ModelResponse:
    last = last_part(messages)
    CALLS.model.append("delegate")
    usage = RequestUsage(input_tokens=100, output_tokens=1)
    if isinstance(last, ToolReturnPart):
        return ModelResponse(parts=[TextPart(f"it said {last.content['summary']}")],
                             usage=usage)
    return ModelResponse(parts=[ToolCallPart("PydResearcher", {"prompt": "QUIC"},
                                             tool_call_id="del-1")], usage=usage)


delegator = Agent(FunctionModel(delegating), name="PydDelegator",
                  tools=[tether_tool("PydResearcher", description="Researches a topic"),
                         tether_tool("Echoer", description="Echoes", input_model=Words)])

PydResearcher = child(research, description="Looks a question up")
PydPublisher = child(publisher)
PydDelegator = child(delegator)


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether,
                        [PydResearcher, PydPublisher, PydDelegator, Echoer])
        await started.start_parent()
        try:
            yield started
        finally:
            CALLS.gate.set()
            await started.close()


async def test_a_run_records_each_model_request_and_tool_call_with_its_usage(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("PydResearcher", {"prompt": "HTTP/3"}, run_id="plain"),
        DEADLINE_S)
    assert result.ok and result.summary == "found: two sources on HTTP/3", result
    assert CALLS.model == ["look up", "answer"] and CALLS.tools == ["HTTP/3"]
    state = await stack.state("plain")
    assert [(s["kind"], s["key"]) for _, s in sorted(state.steps.items())] == [
        ("model", "0:model:0"), ("tool", "0:tool:look-1"), ("model", "0:model:1")]
    assert UsageView.of_steps(state.steps) == UsageView(input_tokens=20, output_tokens=10,
                                                        total_tokens=30, cost=None)
    assert state.output_parts and "found: two sources on HTTP/3" in "".join(
        state.output_parts.values())


async def test_a_runner_that_stops_mid_run_leaves_the_next_to_replay_what_was_recorded(stack):
    first = await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("PydResearcher", {"prompt": "gRPC"}, run_id="taken"))

    async def answering():
        return CALLS.model == ["look up", "answer"]

    await eventually(answering, timeout=DEADLINE_S)  # the second request waits at the gate
    await stack.stop_runner(first)
    await stack.start_runner()

    async def asked_again():
        return CALLS.model == ["look up", "answer", "answer"]

    await eventually(asked_again, timeout=DEADLINE_S)
    CALLS.gate.set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "found: two sources on gRPC", result
    # The first request and the tool call were recorded: given back, not made again.
    assert CALLS.tools == ["gRPC"]
    state = await stack.state("taken")
    assert state.attempt == 2
    assert [s["key"] for _, s in sorted(state.steps.items())] == [
        "0:model:0", "0:tool:look-1", "0:model:1"]


async def test_a_tool_that_needs_approval_pauses_the_run_until_a_human_answers(stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("PydPublisher", {"prompt": "go"}, run_id="approve"))

    state = await stack.until_paused("approve")
    assert state.paused.pending == [{"tool_call_id": "pub-1", "tool_name": "publish",
                                     "input": {"text": "hello"}, "reason": "approval"}]
    assert CALLS.tools == []
    await stack.parent.continue_run("approve", approvals=["pub-1"])
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "done: published hello", result
    assert CALLS.tools == ["hello"]
    assert CALLS.model == ["publish", "publish"], "the first request was not made again"


async def test_cancelling_the_run_cancels_the_model_request_in_flight(stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("PydResearcher", {"prompt": "x"}, run_id="cancelled"))

    async def waiting():
        return CALLS.model == ["look up", "answer"]

    await eventually(waiting, timeout=DEADLINE_S)
    await stack.parent.cancel("cancelled")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok and result.status == "aborted", result


async def test_a_pydantic_ai_parent_delegates_to_tether_children_and_counts_their_usage(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("PydDelegator", {"prompt": "research QUIC"},
                                    run_id="delegates"), DEADLINE_S)
    assert result.ok and result.summary == "it said found: two sources on QUIC", result
    snapshot = await stack.parent.inspect("delegates")
    # Its own two requests, and the researcher's two below it.
    assert snapshot.subtree_usage.input_tokens == 220


async def test_the_delegated_usage_counts_against_the_parents_usage_limits(stack):
    """Outside a Tether run: the tool runs the child under the parent it was given, and
    the child's usage is added to the agent's run before its next request."""
    await stack.start_runner()
    CALLS.gate.set()
    agent = Agent(FunctionModel(delegating), tools=[tether_tool(
        "PydResearcher", description="Researches", parent=stack.parent)])
    result = await agent.run("research", usage_limits=UsageLimits(total_tokens_limit=1000))
    assert result.output == "it said found: two sources on QUIC"
    assert result.usage.input_tokens == 220  # 2 x 100 of its own, 2 x 10 of the child
    with pytest.raises(Exception, match="total_tokens_limit of 130"):
        await agent.run("research", usage_limits=UsageLimits(total_tokens_limit=130))


async def echoing(messages, info: AgentInfo):
    """Streamed (an event stream asks for it): the call, then what the child said."""
    if isinstance(last := last_part(messages), ToolReturnPart):
        yield f"it said {last.content['summary']}"
    else:
        yield {0: DeltaToolCall(name="Echoer", json_args='{"text": "hi"}', tool_call_id="e-1")}


async def test_the_delegated_runs_progress_is_in_the_agents_event_stream(stack):
    await stack.start_runner()
    agent = Agent(FunctionModel(stream_function=echoing), tools=[tether_tool(
        "Echoer", description="Echoes", input_model=Words, parent=stack.parent)])
    events: list[TetherRunEvent] = []

    async def handle(ctx, stream) -> None:
        async for event in stream:
            if isinstance(event, TetherRunEvent):
                events.append(event)
                if "echoing" in event.milestones:
                    CALLS.gate.set()  # the child's milestone reached the stream while it ran

    result = await asyncio.wait_for(agent.run("echo hi", event_stream_handler=handle),
                                    DEADLINE_S)
    assert result.output == "it said echo hi"
    assert CALLS.gate.is_set()
    assert (events[-1].status, events[-1].summary, events[-1].tool_call_id) == (
        "completed", "echo hi", "e-1")


async def fanning_out(messages, info: AgentInfo) -> AsyncIterator:
    """Two delegations in one response; then what both children said."""
    if isinstance(last_part(messages), ToolReturnPart):
        returns = [part.content["summary"] for part in messages[-1].parts
                   if isinstance(part, ToolReturnPart)]
        yield " and ".join(sorted(returns))
    else:
        yield {index: DeltaToolCall(name="Echoer", json_args=json.dumps({"text": word}),
                                    tool_call_id=f"e-{word}")
               for index, word in enumerate(("one", "two"))}


async def test_an_agent_fans_out_two_children_at_once_and_sees_the_progress_of_each(stack):
    await stack.start_runner()
    agent = Agent(FunctionModel(stream_function=fanning_out), tools=[tether_tool(
        "Echoer", description="Echoes", input_model=Words, parent=stack.parent)])
    echoing: set[str] = set()

    async def handle(ctx, stream) -> None:
        async for event in stream:
            if isinstance(event, TetherRunEvent) and "echoing" in event.milestones:
                echoing.add(event.tool_call_id)
                if len(echoing) == 2:
                    CALLS.gate.set()  # both children ran at once, the stream showed each

    result = await asyncio.wait_for(  # one child after the other would wait forever
        agent.run("fan out", event_stream_handler=handle), DEADLINE_S)
    assert echoing == {"e-one", "e-two"}
    assert result.output == "echo one and echo two"


async def starting(messages, info: AgentInfo) -> ModelResponse:
    if isinstance(last := last_part(messages), ToolReturnPart):
        return ModelResponse(parts=[TextPart(f"started {last.content['run_id']}")])
    return ModelResponse(parts=[ToolCallPart("PydResearcher", {"prompt": "later"},
                                             tool_call_id="later-1")])


async def test_a_detached_delegation_answers_with_the_runs_handle_and_the_run_goes_on(stack):
    await stack.start_runner()
    CALLS.gate.set()
    agent = Agent(FunctionModel(starting), tools=[tether_tool(
        "PydResearcher", description="Researches", parent=stack.parent,
        detached={"notify": True})])
    result = await asyncio.wait_for(agent.run("start it"), DEADLINE_S)
    run_id = result.output.removeprefix("started ")

    async def completed():
        snapshot = await stack.parent.inspect(run_id)
        return snapshot is not None and snapshot.status == "completed" and snapshot

    assert (await eventually(completed, timeout=DEADLINE_S)).summary == (
        "found: two sources on later")
    # Its end is a chat message in the parent's conversation, for the application to
    # give its agent on the next turn.
    async with asyncio.timeout(DEADLINE_S):
        async for message in stack.parent.chat():
            if message.metadata.get("run_id") == run_id:
                break
    assert "found: two sources on later" in message.content
