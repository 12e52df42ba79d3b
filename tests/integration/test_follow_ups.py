"""Follow-up turns, over real NATS and Postgres: a finished run asked again goes on with what
it recorded (a model child its conversation); each turn has its own outcome and its own
notification; the same turn asked again is that turn; a child that takes no follow-up, or
a run that has not ended, refuses one, saying why; a model parent follows up a child it
called before."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from eventually import eventually
from pydantic import BaseModel
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.agents import AgentDefinition, ModelAgent
from tether.agents.devtools import render_run
from tether.agents.model_messages import (
    Message,
    ModelRequest,
    ModelResponse,
    TokenUsage,
    ToolCall,
)
from tether.client import agent_tool

DEADLINE_S = 30


class Recall:
    """A model that notes what it is told to remember, and says it when asked."""

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        self.requests.append(request)
        said = [m.content for m in request.messages if m.role == "user"]
        if said[-1].startswith("remember "):
            answer = "noted"
        else:
            remembered = [text.removeprefix("remember ") for text in said
                          if text.startswith("remember ")]
            answer = f"you said {remembered[-1]}" if remembered else "you said nothing"
        return ModelResponse(message=Message.assistant(answer),
                             usage=TokenUsage(input_tokens=10, output_tokens=2))


class Rememberer(ModelAgent):
    definition = AgentDefinition(id="rememberer", model="m", max_steps=2)
    description = "Remembers what it is told"
    model_client = Recall()


class Count(BaseModel):
    fail: bool = False


class Counter(ChildAgent):
    """Counts its turns in its own steps; takes a follow-up after a failure too."""

    input_model = Count
    follow_ups = frozenset({"completed", "error"})

    async def run(self, ctx: RunContext, input: Count) -> str:
        steps = ctx.history.steps if ctx.history is not None else {}
        await ctx.record_step(len(steps), {"turn": ctx.turn})
        if input.fail:
            raise RuntimeError(f"turn {ctx.turn} failed as asked")
        return f"turn {ctx.turn}: {len(steps) + 1} steps"


class Flaky(ChildAgent):
    """Records a step, waits for the test, then fails until its bug is fixed."""

    release: asyncio.Event
    fixed = False

    async def run(self, ctx: RunContext, input: Any) -> str:
        if not (ctx.history and 0 in ctx.history.steps):
            await ctx.record_step(0, {"did": "stage 0"})
        await Flaky.release.wait()
        if not Flaky.fixed:
            raise RuntimeError("the export tool had a bug")
        return "exported"


class OneShot(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        return "once"


class Following:
    """A parent model: asks the Rememberer to remember, then asks that run again."""

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        results = [m for m in request.messages if m.role == "tool"]
        if not results:
            call = ToolCall(id="first", name="Rememberer", input={"input": "remember 42"})
        elif len(results) == 1:
            call = ToolCall(id="again", name="Rememberer", input={
                "input": "what did I say?", "follow_up": "agent-tool:first"})
        else:
            return ModelResponse(message=Message.assistant(
                " / ".join(m.content for m in results)))
        return ModelResponse(message=Message.assistant("", (call,)))


class Planner(ModelAgent):
    definition = AgentDefinition(id="planner", model="m", max_steps=4,
                                 tools=(agent_tool(Rememberer),))
    model_client = Following()


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    Rememberer.model_client = Recall()
    Flaky.release, Flaky.fixed = asyncio.Event(), False
    async with running_stack(settings, log, pool,
                             [Rememberer, Counter, OneShot, Planner, Flaky]) as started:
        yield started


async def ask(stack: Stack, agent_type: str, input: dict, **options: Any):
    return await asyncio.wait_for(
        stack.parent.run_agent_tool(agent_type, input, **options), DEADLINE_S)


async def test_a_follow_up_turn_goes_on_with_the_conversation_and_has_its_own_outcome(stack):
    first = await ask(stack, "Rememberer", {"input": "remember 42"}, run_id="chat")
    assert first.ok and first.summary == "noted", first
    second = await ask(stack, "Rememberer", {"input": "what did I say?"}, follow_up="chat")
    assert second.ok and second.summary == "you said 42", second

    asked = Rememberer.model_client.requests[-1].messages
    assert [m.content for m in asked] == ["remember 42", "noted", "what did I say?"]
    state = await stack.state("chat")
    assert (state.turn, state.status, state.summary) == (2, "completed", "you said 42")
    (turn,) = state.turns
    assert (turn.turn, turn.status, turn.summary, turn.input["input"]) == (
        1, "completed", "noted", "remember 42")
    assert state.turn_first_step == 1 and len(state.steps) == 3  # the opening, the answer
    shown = render_run(state)
    assert "turn 1    completed" in shown and "turn 2" in shown, shown


async def test_the_same_turn_asked_again_is_that_turn_and_never_a_second_one(stack):
    assert (await ask(stack, "Counter", {}, run_id="count")).summary == "turn 1: 1 steps"
    for _ in range(2):
        again = await ask(stack, "Counter", {}, follow_up="count", turn=2)
        assert again.ok and again.summary == "turn 2: 2 steps", again
    assert (await ask(stack, "Counter", {}, follow_up="count")).summary == "turn 3: 3 steps"
    # Turn 2 asked once more after turn 3: its own outcome, kept.
    assert (await ask(stack, "Counter", {}, follow_up="count", turn=2)).summary == (
        "turn 2: 2 steps")
    state = await stack.state("count")
    assert state.turn == 3 and [t.turn for t in state.turns] == [1, 2]
    turns = [e for e in (await stack.tether.read_run(stack.parent.ref, "count")).events
             if e.type == "run.turn_requested"]
    assert [e.data.turn for e in turns] == [2, 3]


async def test_a_follow_up_that_is_not_taken_says_why(stack):
    assert (await ask(stack, "OneShot", {}, run_id="once")).ok
    refused = await ask(stack, "OneShot", {}, follow_up="once")
    assert not refused.ok and refused.error == "OneShot takes no follow-up turns", refused
    failed = await ask(stack, "Counter", {"fail": True}, run_id="failing")
    assert not failed.ok and failed.error.endswith("turn 1 failed as asked")
    # Counter takes a follow-up after a failure: the turn goes on from what it recorded.
    assert (await ask(stack, "Counter", {}, follow_up="failing")).summary == "turn 2: 2 steps"
    nothing = await ask(stack, "Counter", {}, follow_up="no-such-run")
    assert not nothing.ok and nothing.error == "no run 'no-such-run' to follow up"
    with pytest.raises(ValueError, match="not both"):
        await stack.parent.run_agent_tool("Counter", {}, run_id="a", follow_up="b")


async def test_a_follow_up_or_a_rewind_asked_again_after_a_refusal_is_applied(stack):
    # Within the stream's duplicate window: the refused request's id must not make the
    # stream drop the one asked again (the caller then waited for ever).
    assert (await ask(stack, "Counter", {}, run_id="count")).ok
    bad = await ask(stack, "Counter", {"fail": "sometimes"}, follow_up="count")
    assert not bad.ok and "fail" in bad.error, bad
    assert (await ask(stack, "Counter", {}, follow_up="count")).summary == "turn 2: 2 steps"

    flaky = asyncio.create_task(ask(stack, "Flaky", {}, run_id="export"))

    async def one_step_recorded():
        state = await stack.state("export")
        return state is not None and 0 in state.steps

    await eventually(one_step_recorded, timeout=DEADLINE_S)
    early = await asyncio.wait_for(stack.parent.rewind("export"), DEADLINE_S)
    assert not early.ok and "only a failed run is rewound" in early.error, early
    Flaky.release.set()
    assert not (await flaky).ok
    Flaky.fixed = True
    rewound = await asyncio.wait_for(stack.parent.rewind("export"), DEADLINE_S)
    assert rewound.ok and rewound.summary == "exported", rewound


async def test_each_turn_of_a_detached_run_is_notified_on_its_own(stack):
    await ask(stack, "Counter", {}, run_id="told", detached={"notify": True})
    told = []
    async with asyncio.timeout(DEADLINE_S):
        async for message in stack.parent.chat():
            if message.metadata.get("run_id") == "told":
                told.append(message)
                if len(told) == 1:
                    handle = await ask(stack, "Counter", {}, follow_up="told",
                                       detached={"notify": True})
                    assert handle.status == "running", handle
                if len(told) == 2:
                    break
    assert len({message.id for message in told}) == 2
    assert "turn 1: 1 steps" in told[0].content and "turn 2: 2 steps" in told[1].content


async def test_a_model_parent_follows_up_a_child_it_called_before(stack):
    result = await ask(stack, "Planner", {"input": "remember, then ask"}, run_id="planner")
    assert result.ok and result.summary == "noted / you said 42", result
    owner = (await stack.state("planner")).as_parent()
    child = (await stack.tether.read_run(owner, "agent-tool:first")).state
    assert (child.turn, child.parent_tool_call_id) == (2, "again")
    assert [t.summary for t in child.turns] == ["noted"]
    # The tool offers the follow-up to the model.
    schema = Planner.definition.tool("Rememberer").spec().parameters
    assert "follow_up" in schema["properties"], json.dumps(schema)
