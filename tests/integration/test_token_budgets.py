"""Budgets in tokens over a tree of runs, over real NATS and Postgres: nested calls
reserve their share before they start, so eight at once under a budget that allows four
start four; what a run below used is charged and what it did not use freed when it
ends; a budget passed in a grandchild ends the budgeted run `interrupted`
(`budget-exceeded`), cancels the runs below it, and the model parent above sees the
failure."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from budget_agents import ASKED, GATES, Far, Hog, Leaf, gated_stack
from eventually import eventually
from pydantic import BaseModel
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.agents import AgentDefinition, ModelAgent, ToolContext, tool
from tether.agents.devtools import render_run
from tether.agents.model_messages import (
    Message,
    ModelRequest,
    ModelResponse,
    TokenUsage,
    ToolCall,
)
from tether.client import agent_tool
from tether.domain import spending

DEADLINE_S = 30


class Calls:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.spender_turns = 0


CALLS = Calls()


class Job(BaseModel):
    n: int


class Worker(ChildAgent):
    """Reserves 1,000 tokens of a budget above it; uses 300 (a recorded model step)."""

    input_model = Job
    estimated_tokens = 1_000

    async def run(self, ctx: RunContext, input: Job) -> str:
        await ctx.record_step(0, {"kind": "model", "turn": {"usage": {
            "input_tokens": 200, "output_tokens": 100}}})
        return f"done {input.n}"


class FanOut(ChildAgent):
    """Eight Workers at once under its budget of 4,000 tokens."""

    max_tokens = 4_000

    async def run(self, ctx: RunContext, input: Any) -> dict:
        results = await asyncio.gather(*(ctx.run_agent_tool("Worker", {"n": n})
                                         for n in range(8)))
        return {"started": sum(1 for r in results if r.ok),
                "refused": [r.reason for r in results if not r.ok]}


class OneByOne(ChildAgent):
    """Three Workers one after another under a budget of 2,000 tokens; between them it
    waits for the test's gate."""

    max_tokens = 2_000

    async def run(self, ctx: RunContext, input: Any) -> list:
        results = []
        for n in range(3):
            results.append((await ctx.run_agent_tool("Worker", {"n": n})).ok)
            await CALLS.gate.wait()
            CALLS.gate.clear()
        return results


class Thought(BaseModel):
    pass


@tool
async def think(ctx: ToolContext, input: Thought) -> str:
    """Thinks a little more."""
    return "thought"


class Spending:
    """A model that calls `think` again and again, 400 tokens a turn; its fourth request
    never answers (only a cancel ends it)."""

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        CALLS.spender_turns += 1
        if CALLS.spender_turns >= 4:
            await asyncio.Event().wait()
        return ModelResponse(
            message=Message.assistant("", (ToolCall(id=f"t{CALLS.spender_turns}",
                                                    name="think", input={}),)),
            usage=TokenUsage(input_tokens=300, output_tokens=100))


class Spender(ModelAgent):
    definition = AgentDefinition(id="spender", model="m", max_steps=10, tools=(think,))
    model_client = Spending()


class Budgeted(ChildAgent):
    """Hands its task to a Spender, under a budget of 1,000 tokens."""

    max_tokens = 1_000
    description = "Does a task within 1,000 tokens"

    async def run(self, ctx: RunContext, input: Any) -> str:
        result = await ctx.run_agent_tool("Spender", {"input": "spend"})
        return result.summary if result.ok else result.error


class Delegating:
    """A parent model: calls Budgeted, then says what came back."""

    async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
        results = [m for m in request.messages if m.role == "tool"]
        if not results:
            return ModelResponse(message=Message.assistant("", (ToolCall(
                id="budgeted", name="Budgeted", input={}),)))
        try:
            failure = json.loads(results[-1].content)
        except json.JSONDecodeError:  # a summary: it did not fail
            return ModelResponse(message=Message.assistant(results[-1].content))
        return ModelResponse(message=Message.assistant(
            f"{failure['status']} ({failure.get('reason')}): {failure['error']}"))


class Planner(ModelAgent):
    definition = AgentDefinition(id="planner", model="m", max_steps=4,
                                 tools=(agent_tool(Budgeted),))
    model_client = Delegating()


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with running_stack(settings, log, pool,
                             [Worker, FanOut, OneByOne, Spender, Budgeted, Planner],
                             runner=False) as started:
        try:
            yield started
        finally:
            CALLS.gate.set()


async def test_eight_nested_calls_at_once_under_a_budget_that_allows_four_start_four(stack):
    await stack.start_runner()  # (no reconciler: no reservation is freed meanwhile)
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("FanOut", {}, run_id="fan"), DEADLINE_S)
    assert result.ok, result
    assert result.output == {"started": 4, "refused": ["budget-exceeded"] * 4}
    state = await stack.state("fan")
    below = [(await stack.log.read_run(state.as_parent(), run_id)).state
             for run_id in await stack.log.run_ids(state.as_parent())]
    assert len(below) == 8 and sum(1 for run in below if run is not None) == 4, below
    # (a refused call's subject holds its refusal only: it made no run)
    assert spending.reserved(state).tokens == 4_000 and spending.left(state) == (0, None)


async def test_a_run_below_is_charged_what_it_used_and_frees_the_rest_when_it_ends(stack):
    await stack.start_runner()
    reconciler = await stack.start_reconciler()
    call = asyncio.create_task(stack.parent.run_agent_tool("OneByOne", {}, run_id="one"))

    async def settled(count: int):
        state = await stack.state("one")
        shares = list(state.spending.values()) if state else []
        return (len(shares) == count and all(s.released for s in shares)
                and spending.spent(state).tokens == 300 * count and state)

    for count in (1, 2):
        await eventually(lambda count=count: settled(count), timeout=DEADLINE_S)
        # The metrics: what the open budgeted runs spent, reserve and have left.
        totals = await eventually(lambda count=count: (
            reconciler.budget_totals()[("tokens", "spent")] == 300 * count
            and reconciler.budget_totals()), timeout=DEADLINE_S)
        assert (totals[("tokens", "reserved")], totals[("tokens", "left")]) == (
            0, 2_000 - 300 * count)
        CALLS.gate.set()  # reserved 1,000 and used 300: the next call fits
    state = await eventually(lambda: settled(3), timeout=DEADLINE_S)
    CALLS.gate.set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == [True, True, True], result
    assert spending.left(state) == (1_100, None)
    shown = render_run(state)
    assert "budget    900 of 2,000 tokens spent, 0 reserved, 1,100 left" in shown, shown


async def test_a_budget_passed_in_a_grandchild_interrupts_the_budgeted_run_and_its_tree(
        stack):
    await stack.start_runner()
    await stack.start_reconciler()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Planner", {"input": "plan"}, run_id="planner"),
        DEADLINE_S)
    # The model parent got the budgeted run's failure as its tool result.
    assert result.ok and result.summary.startswith("interrupted (budget-exceeded): the run "
                                                   "and the runs below it used 1,200 tokens "
                                                   "of its 1,000-token budget"), result
    planner = await stack.state("planner")
    owner = planner.as_parent()
    budgeted = (await stack.tether.read_run(owner, "agent-tool:budgeted")).state
    assert (budgeted.status, budgeted.reason) == ("interrupted", "budget-exceeded")
    assert spending.spent(budgeted).tokens == 1_200
    (spender_id,) = await stack.log.run_ids(budgeted.as_parent())  # (no refusal there)

    async def spender_stopped():
        state = (await stack.tether.read_run(budgeted.as_parent(), spender_id)).state
        return state.status == "aborted" and state

    spender = await eventually(spender_stopped, timeout=DEADLINE_S)
    assert spender.budgets_above[0].run_id == "agent-tool:budgeted"
    assert CALLS.spender_turns == 4  # the fourth request was in flight when it stopped


class Drafter(ChildAgent):
    """Two model steps of 100 tokens each, skipping the ones it has (a fork's reused
    steps); reserves 300 of a budget above it."""

    estimated_tokens = 300

    async def run(self, ctx: RunContext, input: Any) -> str:
        done = ctx.history.steps if ctx.history is not None else {}
        for index in (0, 1):
            if index not in done:
                await ctx.record_step(index, {"kind": "model", "turn": {"usage": {
                    "input_tokens": 100, "output_tokens": 0}}})
        return "drafted"


class Supervisor(ChildAgent):
    """Runs a Drafter under its budget of 1,000 tokens, then waits for the test's gate."""

    max_tokens = 1_000

    async def run(self, ctx: RunContext, input: Any) -> str:
        result = await ctx.run_agent_tool("Drafter", {}, run_id="draft")
        await CALLS.gate.wait()
        return result.summary if result.ok else result.error


@pytest.fixture
async def fork_stack(settings, log, pool) -> AsyncIterator[Stack]:
    global CALLS
    CALLS = Calls()
    async with running_stack(settings, log, pool, [Drafter, Supervisor],
                             reconciler=True) as started:
        try:
            yield started
        finally:
            CALLS.gate.set()


async def test_a_fork_below_a_budget_is_charged_only_the_steps_it_made(fork_stack):
    stack = fork_stack
    call = asyncio.create_task(stack.parent.run_agent_tool("Supervisor", {}, run_id="boss"))

    async def settled(shares: int):
        state = await stack.state("boss")
        return (state is not None and len(state.spending) == shares
                and all(share.released for share in state.spending.values()) and state)

    boss = await eventually(lambda: settled(1), timeout=DEADLINE_S)
    assert spending.spent(boss).tokens == 200
    below = stack.tether.parent(boss.as_parent().agent, boss.as_parent().name)

    fork = await asyncio.wait_for(below.fork("draft", at="step:1"), DEADLINE_S)

    assert fork.ok, fork
    boss = await eventually(lambda: settled(2), timeout=DEADLINE_S)
    # The fork made step 1 (100 tokens); its step 0 was the original's, paid already.
    assert spending.spent(boss).tokens == 300, boss.spending
    share = next(s for key, s in boss.spending.items() if key.endswith(fork.run_id))
    assert (share.tokens, share.steps) == (100, (1,))
    CALLS.gate.set()
    assert (await asyncio.wait_for(call, DEADLINE_S)).ok


class Near(ChildAgent):
    """A budget of 400 tokens below Far's: asks for a Leaf, and when Far had no room for
    it, asks for the same Leaf again once its gate opens."""

    max_tokens = 400

    async def run(self, ctx: RunContext, input: Any) -> str:
        ASKED.append(await ctx.run_agent_tool("Leaf", {}, run_id="leaf"))
        await GATES["retry"].wait()
        result = await ctx.run_agent_tool("Leaf", {}, run_id="leaf")
        return result.summary if result.ok else result.error


@pytest.fixture
async def two_budgets(settings, log, pool) -> AsyncIterator[Stack]:
    async with gated_stack(settings, log, pool, [Hog, Leaf, Near, Far],
                           ("hog", "leaf", "retry")) as started:
        yield started


async def test_a_request_refused_by_a_budget_further_up_reserves_again_when_asked_again(
        two_budgets):
    stack = two_budgets
    call = asyncio.create_task(stack.parent.run_agent_tool("Far", {}, run_id="far"))
    await eventually(lambda: ASKED, timeout=DEADLINE_S)
    refused = ASKED[0]
    assert not refused.ok and refused.reason == "budget-exceeded", refused
    far = await stack.state("far")
    near_of = (await stack.tether.read_run(far.as_parent(), "near")).state.as_parent()

    async def near_budget():
        return (await stack.tether.read_run(far.as_parent(), "near")).state

    near = await near_budget()
    assert spending.reserved(near).tokens == 0  # its share was freed with the refusal
    GATES["hog"].set()

    async def room_at_far():
        state = await stack.state("far")
        return spending.left(state)[0] >= 300 and state

    await eventually(room_at_far, timeout=DEADLINE_S)
    GATES["retry"].set()

    async def leaf_running():
        leaf = (await stack.tether.read_run(near_of, "leaf")).state
        return leaf is not None and leaf.status == "running" and leaf

    await eventually(leaf_running, timeout=DEADLINE_S)
    near = await near_budget()
    # Asked again, the Leaf holds its share of Near's budget as it holds Far's.
    assert spending.reserved(near).tokens == 300, near.spending
    assert spending.reserved(await stack.state("far")).tokens == 400 + 300  # Near's, Leaf's
    GATES["leaf"].set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == [True, True], result
