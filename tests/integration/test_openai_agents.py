"""OpenAI Agents SDK agents as Tether children, and Tether children as their tools, with the
real SDK and a scripted `Model` (the SDK's interface; its responses as the SDK's types), on
real NATS and Postgres: every model response and tool result is a step, replayed instead
of made again by the runner that takes a run over; `needs_approval` pauses the run;
usage is the run's."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agents import Agent, Model, ModelResponse, Runner, Usage, function_tool, set_tracing_disabled
from eventually import eventually
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from runner_stack import Stack

from tether.client import connect
from tether.contract.messages import UsageView
from tether.integrations.openai_agents import child, tether_tool

DEADLINE_S = 30
set_tracing_disabled(True)


def call(name: str, arguments: dict, call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(type="function_call", id=f"fc-{call_id}",
                                    call_id=call_id, name=name,
                                    arguments=json.dumps(arguments), status="completed")


def said(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(type="message", id="msg-1", role="assistant",
                                 status="completed", content=[ResponseOutputText(
                                     type="output_text", text=text, annotations=[])])


class Scripted(Model):
    """Answers from a function of the conversation so far; each call is counted, and a
    call the script marks as gated waits for the test's gate."""

    def __init__(self, script, tokens: int = 10) -> None:
        self.script, self.tokens = script, tokens

    async def get_response(self, system_instructions, input, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        output = await self.script(input)
        return ModelResponse(output=output, usage=Usage(
            requests=1, input_tokens=self.tokens, output_tokens=1,
            total_tokens=self.tokens + 1), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError


class Calls:
    def __init__(self) -> None:
        self.model: list[str] = []
        self.tools: list[str] = []
        self.gate = asyncio.Event()


CALLS = Calls()


def tool_outputs(input) -> list[str]:
    return [item["output"] for item in input
            if isinstance(item, dict) and item.get("type") == "function_call_output"]


async def researching(input) -> list:
    if outputs := tool_outputs(input):
        CALLS.model.append("answer")
        await CALLS.gate.wait()
        return [said(f"found: {outputs[-1]}")]
    CALLS.model.append("look up")
    return [call("lookup", {"query": input[-1]["content"] if isinstance(input, list)
                            else input}, "look-1")]


@function_tool
def lookup(query: str) -> str:
    """Looks a query up."""
    CALLS.tools.append(query)
    return f"two sources on {query}"


async def publishing(input) -> list:
    CALLS.model.append("publish")
    if outputs := tool_outputs(input):
        return [said(f"done: {outputs[-1]}")]
    return [call("publish", {"text": "hello"}, "pub-1")]


@function_tool(needs_approval=True)
def publish(text: str) -> str:
    """Publishes a text."""
    CALLS.tools.append(text)
    return f"published {text}"


async def delegating(input) -> list:
    CALLS.model.append("delegate")
    if outputs := tool_outputs(input):
        return [said(f"it said {json.loads(outputs[-1])['summary']}")]
    return [call("OaiResearcher", {"prompt": "QUIC"}, "del-1")]


research = Agent(name="OaiResearcher", model=Scripted(researching), tools=[lookup])
publisher = Agent(name="OaiPublisher", model=Scripted(publishing), tools=[publish])
delegator = Agent(name="OaiDelegator", model=Scripted(delegating, tokens=100),
                  tools=[tether_tool("OaiResearcher", description="Researches a topic")])

OaiResearcher = child(research, description="Looks a question up")
OaiPublisher = child(publisher)
OaiDelegator = child(delegator)


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether, [OaiResearcher, OaiPublisher, OaiDelegator])
        await started.start_parent()
        try:
            yield started
        finally:
            CALLS.gate.set()
            await started.close()


async def test_a_run_records_each_model_response_and_tool_result_with_its_usage(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("OaiResearcher", {"prompt": "HTTP/3"}, run_id="plain"),
        DEADLINE_S)
    assert result.ok and result.summary == "found: two sources on HTTP/3", result
    assert CALLS.model == ["look up", "answer"] and CALLS.tools == ["HTTP/3"]
    state = await stack.state("plain")
    assert [(s["kind"], s["key"]) for _, s in sorted(state.steps.items())] == [
        ("model", "0:model:0"), ("tool", "0:tool:look-1"), ("model", "0:model:1")]
    assert UsageView.of_steps(state.steps) == UsageView(input_tokens=20, output_tokens=2,
                                                        total_tokens=22, cost=None)


async def test_a_runner_that_stops_mid_run_leaves_the_next_to_replay_what_was_recorded(stack):
    first = await stack.start_runner()
    call_ = asyncio.create_task(
        stack.parent.run_agent_tool("OaiResearcher", {"prompt": "gRPC"}, run_id="taken"))

    async def answering():
        return CALLS.model == ["look up", "answer"]

    await eventually(answering, timeout=DEADLINE_S)
    await stack.stop_runner(first)
    await stack.start_runner()

    async def asked_again():
        return CALLS.model == ["look up", "answer", "answer"]

    await eventually(asked_again, timeout=DEADLINE_S)
    CALLS.gate.set()
    result = await asyncio.wait_for(call_, DEADLINE_S)
    assert result.ok and result.summary == "found: two sources on gRPC", result
    assert CALLS.tools == ["gRPC"], "the recorded tool call was not made again"
    assert (await stack.state("taken")).attempt == 2


async def test_a_tool_that_needs_approval_pauses_the_run_until_a_human_answers(stack):
    await stack.start_runner()
    call_ = asyncio.create_task(
        stack.parent.run_agent_tool("OaiPublisher", {"prompt": "go"}, run_id="approve"))

    state = await stack.until_paused("approve")
    assert state.paused.pending == [{"tool_call_id": "pub-1", "tool_name": "publish",
                                     "input": {"text": "hello"}, "reason": "approval"}]
    assert CALLS.tools == []
    await stack.parent.continue_run("approve", approvals=["pub-1"])
    result = await asyncio.wait_for(call_, DEADLINE_S)
    assert result.ok and result.summary == "done: published hello", result
    assert CALLS.tools == ["hello"]
    assert CALLS.model == ["publish", "publish"], "the first request was not made again"


async def test_cancelling_the_run_cancels_the_model_request_in_flight(stack):
    await stack.start_runner()
    call_ = asyncio.create_task(
        stack.parent.run_agent_tool("OaiResearcher", {"prompt": "x"}, run_id="cancelled"))

    async def waiting():
        return CALLS.model == ["look up", "answer"]

    await eventually(waiting, timeout=DEADLINE_S)
    await stack.parent.cancel("cancelled")
    result = await asyncio.wait_for(call_, DEADLINE_S)
    assert not result.ok and result.status == "aborted", result


async def test_an_agents_sdk_parent_delegates_to_tether_children_and_counts_their_usage(stack):
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("OaiDelegator", {"prompt": "research QUIC"},
                                    run_id="delegates"), DEADLINE_S)
    assert result.ok and result.summary == "it said found: two sources on QUIC", result
    snapshot = await stack.parent.inspect("delegates")
    assert snapshot.subtree_usage.input_tokens == 220  # its own 2 x 100, the child's 2 x 10
    # Outside a Tether run, the tool runs the child under the parent it is given, and the
    # child's usage is the calling run's too.
    agent = Agent(name="Desk", model=Scripted(delegating, tokens=100), tools=[tether_tool(
        "OaiResearcher", description="Researches", parent=stack.parent)])
    outside = await Runner.run(agent, "research")
    assert outside.final_output == "it said found: two sources on QUIC"
    assert outside.context_wrapper.usage.input_tokens == 220


async def starting(input) -> list:
    if outputs := tool_outputs(input):
        return [said(f"started {json.loads(outputs[-1])['run_id']}")]
    return [call("OaiResearcher", {"prompt": "later"}, "later-1")]


async def test_a_detached_delegation_answers_with_the_runs_handle_and_the_run_goes_on(stack):
    await stack.start_runner()
    CALLS.gate.set()
    agent = Agent(name="Starter", model=Scripted(starting), tools=[tether_tool(
        "OaiResearcher", description="Researches", parent=stack.parent, detached=True)])
    result = await asyncio.wait_for(Runner.run(agent, "start it"), DEADLINE_S)
    run_id = result.final_output.removeprefix("started ")

    async def completed():
        snapshot = await stack.parent.inspect(run_id)
        return snapshot is not None and snapshot.status == "completed" and snapshot

    assert (await eventually(completed, timeout=DEADLINE_S)).summary == (
        "found: two sources on later")


async def test_the_tools_on_stream_is_told_the_childs_progress_while_it_runs(stack):
    await stack.start_runner()
    told = []

    async def on_stream(event) -> None:
        told.append(event)
        if event["event"].get("progress") == "calling lookup":
            CALLS.gate.set()  # the child waits for this: its progress came while it ran

    agent = Agent(name="Desk", model=Scripted(delegating), tools=[tether_tool(
        "OaiResearcher", description="Researches", parent=stack.parent, on_stream=on_stream)])
    result = await asyncio.wait_for(Runner.run(agent, "research"), DEADLINE_S)
    assert result.final_output == "it said found: two sources on QUIC"
    assert CALLS.gate.is_set()
    assert {event["agent_type"] for event in told} == {"OaiResearcher"}
    assert {event["tool_call"].call_id for event in told} == {"del-1"}
    assert told[-1]["event"]["status"] == "completed"
    assert told[-1]["event"]["summary"] == "found: two sources on QUIC"
    assert told[-1]["event"]["run_id"] == "openai-agents-del-1"
