"""Steering a running child, over real NATS and Postgres: a parent's message is recorded
once per id, handed to the child at its next step boundary with receipts in the run's
log, taken in once across a runner that stops mid-run, refused by a run that takes no
message; one a turn ended without is unread, then carried to a follow-up turn, and the
run's state, timeline and `runs show` say so; an `interrupt` stops a model child's tool
call and model call in flight, and the model goes on with the message."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import steered_agents
from eventually import eventually
from runner_stack import Stack
from steered_agents import Nothing

from tether import ChildAgent, RunContext
from tether.agents import AgentDefinition, ModelAgent, ToolContext, tool
from tether.agents.devtools import render_run
from tether.agents.model_messages import Message, ModelRequest, ModelResponse, ToolCall
from tether.client import agent_tool, connect, message_tool
from tether.client.errors import MessageRefused
from tether.domain.steering_transitions import message_standing

DEADLINE_S = 30


class Calls:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.tool_started = asyncio.Event()
        self.tool_stopped = False
        self.model_asked = asyncio.Event()
        self.requests: list[ModelRequest] = []


CALLS = Calls()


class Listener(steered_agents.Listener):
    """The steered child (it keeps the first message in a step), waiting between the two
    messages for the test's gate."""

    async def between(self) -> None:
        await CALLS.gate.wait()


@tool
async def wait_for_data(ctx: ToolContext, input: Nothing) -> str:
    """Waits for the data to arrive."""
    CALLS.tool_started.set()
    try:
        await asyncio.Event().wait()  # it never arrives: only an interrupt stops it
    except asyncio.CancelledError:
        CALLS.tool_stopped = True
        raise
    return "never"


class Waiting:
    """A model that first calls `wait_for_data` (or, `hang`, never answers its first
    request), then answers with the last user message it was given."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        CALLS.requests.append(request)
        if len(CALLS.requests) == 1:
            CALLS.model_asked.set()
            if self.hang:
                await asyncio.Event().wait()
            return ModelResponse(message=Message.assistant("", (ToolCall(
                id="call-1", name="wait_for_data", input={}),)))
        last = [m.content for m in request.messages if m.role == "user"][-1]
        return ModelResponse(message=Message.assistant(f"went on with: {last}"))


class Patient(ModelAgent):
    definition = AgentDefinition(id="patient", model="m", max_steps=4, tools=(wait_for_data,))
    model_client = Waiting()


class Hanging(ModelAgent):
    definition = AgentDefinition(id="hanging", model="m", max_steps=4, tools=(wait_for_data,))
    model_client = Waiting(hang=True)


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether,
                        [Listener, Patient, Hanging, Hearer, Delegator, Forgetful])
        await started.start_parent()
        try:
            yield started
        finally:
            CALLS.gate.set()
            await started.close()


async def events_of(stack: Stack, run_id: str, kind: str) -> list:
    history = await stack.tether.read_run(stack.parent.ref, run_id)
    return [event for event in history.events if event.type == kind]


async def test_a_message_is_taken_in_once_across_a_runner_that_stops_mid_run(stack):
    first = await stack.start_runner()
    call = asyncio.create_task(stack.parent.run_agent_tool("Listener", {}, run_id="steered"))
    receipt = await stack.parent.send("steered", "focus on QUIC", message_id="m1")
    assert (receipt.run_id, receipt.message_id, receipt.mode) == ("steered", "m1", "queue")
    # Sent again (a retry of the same send): recorded once.
    await stack.parent.send("steered", "focus on QUIC", message_id="m1")

    async def heard():
        state = await stack.state("steered")
        return state.milestones and state

    state = await eventually(heard, timeout=DEADLINE_S)
    assert state.messages[0].consumed_at is not None
    await stack.stop_runner(first)  # gives the run back mid-run
    # Sent while no runner holds the run: the next attempt is handed it.
    await stack.parent.send("steered", "then gRPC", message_id="m2")
    await stack.start_runner()
    CALLS.gate.set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "focus on QUIC + then gRPC", result

    state = await stack.state("steered")
    assert state.attempt == 2 and state.waiting_messages == ()
    assert [m.message_id for m in state.messages] == ["m1", "m2"]
    assert len(await events_of(stack, "steered", "run.message_sent")) == 2
    consumed = await events_of(stack, "steered", "run.message_consumed")
    assert [(e.data.message_id, e.data.attempt) for e in consumed] == [("m1", 1), ("m2", 2)]
    delivered = await events_of(stack, "steered", "run.message_delivered")
    assert [(e.data.message_id, e.data.attempt) for e in delivered] == [("m1", 1), ("m2", 2)]


async def test_a_run_that_takes_no_message_refuses_it_and_says_why(stack):
    await stack.start_runner()
    CALLS.gate.set()
    call = asyncio.create_task(stack.parent.run_agent_tool("Listener", {}, run_id="done"))
    await stack.parent.send("done", "first")
    await stack.parent.send("done", "second")
    assert (await asyncio.wait_for(call, DEADLINE_S)).summary == "first + second"
    with pytest.raises(MessageRefused, match="completed") as refused:
        await stack.parent.send("done", "too late")
    assert refused.value.code == "not-running"
    with pytest.raises(MessageRefused, match="no run 'nobody'"):
        await stack.parent.send("nobody", "hello?")


class Forgetful(ChildAgent):
    """Takes the first message in, then ends its first turn at the test's gate without
    reading more; a follow-up turn reads what is waiting."""

    input_model = Nothing
    follow_ups = frozenset({"completed"})

    async def run(self, ctx: RunContext, input: Nothing) -> str:
        if ctx.turn == 1:
            first = await ctx.next_message()
            await ctx.report_progress(milestone="heard", message=f"heard {first.text}")
            await CALLS.gate.wait()
            return f"turn 1 read {first.message_id}"
        read = await ctx.messages()
        return "turn 2 read " + ", ".join(
            f"{m.message_id} (sent in turn {m.sent_in_turn})" for m in read)


async def test_a_message_a_turn_ended_without_is_unread_then_carried_to_the_next_turn(stack):
    await stack.start_runner()
    call = asyncio.create_task(stack.parent.run_agent_tool("Forgetful", {}, run_id="forgets"))
    await stack.parent.send("forgets", "focus on QUIC", message_id="read")

    async def heard():
        state = await stack.state("forgets")
        return state.milestones and state

    await eventually(heard, timeout=DEADLINE_S)
    await stack.parent.send("forgets", "and gRPC", message_id="late")
    CALLS.gate.set()
    assert (await asyncio.wait_for(call, DEADLINE_S)).summary == "turn 1 read read"

    async def timeline_of_run():
        async for view in stack.parent.timeline(run_id="forgets", live=False):
            run = view.runs.get("forgets")
        return run

    # Turn 1 ended without `late`: the sender can tell it was never read.
    state = await stack.state("forgets")
    assert {m.message_id: message_standing(state, m) for m in state.messages} == {
        "read": "read", "late": "unread"}
    run = await timeline_of_run()
    assert [(m.message_id, m.standing) for m in run.messages] == [
        ("read", "read"), ("late", "unread")]
    assert "unread: turn 1 ended without it" in render_run(state), render_run(state)

    second = await asyncio.wait_for(stack.parent.run_agent_tool(
        "Forgetful", {}, follow_up="forgets"), DEADLINE_S)
    assert second.ok and second.summary == "turn 2 read late (sent in turn 1)", second

    state = await stack.state("forgets")
    assert state.turns[0].unread_messages == ("late",)
    late = state.message("late")
    assert late is not None and (late.sent_in_turn, late.consumed_in_turn) == (1, 2)
    run = await timeline_of_run()
    assert [(m.message_id, m.standing, m.consumed_in_turn) for m in run.messages] == [
        ("read", "read", 1), ("late", "carried", 2)]
    assert run.turns[0].unread_messages == ("late",)
    shown = render_run(state)
    assert "carried from turn 1: taken in by turn 2" in shown, shown


async def test_an_interrupt_stops_the_tool_call_in_flight_and_the_model_goes_on(stack):
    await stack.start_runner()
    call = asyncio.create_task(stack.parent.run_agent_tool(
        "Patient", {"input": "fetch the data"}, run_id="patient"))
    await asyncio.wait_for(CALLS.tool_started.wait(), DEADLINE_S)
    await stack.parent.send("patient", "stop waiting and answer", mode="interrupt")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "went on with: stop waiting and answer", result
    assert CALLS.tool_stopped
    second = CALLS.requests[1].messages
    answered = next(m for m in second if m.role == "tool")
    assert answered.is_error and "interrupted" in answered.content
    assert second[-1] == Message.user("stop waiting and answer")
    state = await stack.state("patient")
    assert state.messages[0].consumed_at is not None
    # `tether runs show`: the step that took the message in, and the message's receipts.
    shown = render_run(state)
    assert "told  [interrupt] stop waiting and answer" in shown, shown
    message_line = next(line for line in shown.splitlines() if line.startswith("message "))
    assert "[interrupt]" in message_line and "taken in +" in message_line, message_line


async def test_an_interrupt_stops_the_model_call_in_flight_and_asks_again_with_it(stack):
    await stack.start_runner()
    call = asyncio.create_task(stack.parent.run_agent_tool(
        "Hanging", {"input": "think hard"}, run_id="hanging"))
    await asyncio.wait_for(CALLS.model_asked.wait(), DEADLINE_S)
    await stack.parent.send("hanging", "answer now", mode="interrupt")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "went on with: answer now", result
    assert [m.content for m in CALLS.requests[1].messages if m.role == "user"] == [
        "think hard", "answer now"]
    assert not CALLS.tool_started.is_set()  # the first answer never came


class Hearer(ChildAgent):
    input_model = Nothing
    description = "Waits for a word from its parent"

    async def run(self, ctx: RunContext, input: Nothing) -> str:
        message = await ctx.next_message()
        return f"heard: {message.text}"


class Steering:
    """A parent model: starts a Hearer in the background, tells it what to use, answers
    with what the message tool said."""

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        results = [m for m in request.messages if m.role == "tool"]
        if not results:
            call = ToolCall(id="start", name="Hearer", input={})
        elif len(results) == 1:
            handle = json.loads(results[0].content)
            call = ToolCall(id="tell", name="message_run",
                            input={"run_id": handle["run_id"], "text": "use QUIC"})
        else:
            return ModelResponse(message=Message.assistant(results[-1].content))
        return ModelResponse(message=Message.assistant("", (call,)))


class Delegator(ModelAgent):
    definition = AgentDefinition(id="delegator", model="m", max_steps=4, tools=(
        agent_tool(Hearer, detached=True), message_tool()))
    model_client = Steering()


async def test_a_model_parent_steers_a_child_it_started_with_the_message_tool(stack):
    await stack.start_runner()
    result = await asyncio.wait_for(stack.parent.run_agent_tool(
        "Delegator", {"input": "start one and tell it"}, run_id="delegator"), DEADLINE_S)
    assert result.ok, result
    assert result.summary == ("sent to run agent-tool:start: its agent takes the message in "
                              "at its next step")
    owner = (await stack.state("delegator")).as_parent()
    me = stack.tether.parent(owner.agent, owner.name)

    async def heard():
        snapshot = await me.inspect("agent-tool:start")
        return snapshot is not None and snapshot.status == "completed" and snapshot

    assert (await eventually(heard, timeout=DEADLINE_S)).summary == "heard: use QUIC"
    state = (await stack.tether.read_run(owner, "agent-tool:start")).state
    assert [m.message_id for m in state.messages] == ["message-tell"]
