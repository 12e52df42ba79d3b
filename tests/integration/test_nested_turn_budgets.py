"""Follow-up turns and rewinds of runs below a budget, over real NATS and Postgres: a new
turn of a nested run reserves its share of the budgets above it as a fresh nested run
does (its earlier turn's share was freed as it ended), and is refused, saying why,
when a budget above has no room for it."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from budget_agents import ASKED, GATES, Hog, gated_stack
from eventually import eventually
from pydantic import BaseModel
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.domain import spending

DEADLINE_S = 30
SHARE = 600  # what a Chatty or a Fragile reserves of each budget above it


class Job(BaseModel):
    n: int = 0


def model_step(tokens: int) -> dict[str, Any]:
    return {"kind": "model", "turn": {"usage": {"input_tokens": tokens, "output_tokens": 0}}}


class Chatty(ChildAgent):
    """100 tokens a turn; a follow-up turn waits for its gate."""

    input_model = Job
    estimated_tokens = SHARE
    follow_ups = frozenset({"completed"})

    async def run(self, ctx: RunContext, input: Job) -> str:
        steps = ctx.history.steps if ctx.history is not None else {}
        await ctx.record_step(len(steps), model_step(100))
        if ctx.turn > 1:
            await GATES["turn"].wait()
        return f"turn {ctx.turn}"


class Fragile(ChildAgent):
    """100 tokens, then fails; rewound, 100 tokens more, and waits for its gate."""

    input_model = Job
    estimated_tokens = SHARE

    async def run(self, ctx: RunContext, input: Job) -> str:
        steps = ctx.history.steps if ctx.history is not None else {}
        if not steps:
            await ctx.record_step(0, model_step(100))
            raise RuntimeError("a bug, fixed since")
        await ctx.record_step(1, model_step(100))
        await GATES["turn"].wait()
        return "rewound"


class Boss(ChildAgent):
    """A budget of 1,000 tokens: a Chatty (or a Fragile that fails), then (at `start-hog`,
    once the first turn's share is freed) beside a Hog,
    a new turn of it (a follow-up, or a rewind) when the test opens `ask`, and once more
    when it opens `retry` if that was refused."""

    input_model = Job  # n: 0 follows a Chatty up, 1 rewinds a Fragile
    max_tokens = 1_000

    async def run(self, ctx: RunContext, input: Job) -> Any:
        rewind = input.n == 1
        first = await ctx.run_agent_tool("Fragile" if rewind else "Chatty", {}, run_id="nested")
        await GATES["start-hog"].wait()
        hog = asyncio.create_task(ctx.run_agent_tool("Hog", {}, run_id="hog"))
        for gate in ("ask", "retry"):
            await GATES[gate].wait()
            result = await (ctx.client.rewind("nested") if rewind else ctx.run_agent_tool(
                "Chatty", {"n": 2}, follow_up="nested"))
            ASKED.append(result)
            if result.ok:
                break
        return [first.ok, (await hog).ok, [r.ok for r in ASKED]]


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    async with gated_stack(settings, log, pool, [Chatty, Fragile, Hog, Boss],
                           ("start-hog", "ask", "retry", "hog", "turn")) as started:
        yield started


@pytest.mark.parametrize("kind", ["follow-up", "rewind"])
async def test_a_new_turn_of_a_nested_run_reserves_its_share_or_is_refused_saying_why(
        stack, kind):
    call = asyncio.create_task(stack.parent.run_agent_tool(
        "Boss", {"n": 1 if kind == "rewind" else 0}, run_id="boss"))

    async def boss_holding(tokens: int, shares: int):
        boss = await stack.state("boss")
        if boss is None:
            return None
        held = [s for s in boss.spending.values() if not s.released]
        return (len(boss.spending) == shares and spending.reserved(boss).tokens == tokens
                and len(held) == (1 if tokens else 0) and boss)

    # The first turn used 100 tokens and freed the rest; then a Hog holds 500 of 900 left.
    await eventually(lambda: boss_holding(0, 1), timeout=DEADLINE_S)
    GATES["start-hog"].set()
    await eventually(lambda: boss_holding(500, 2), timeout=DEADLINE_S)
    GATES["ask"].set()
    await eventually(lambda: ASKED, timeout=DEADLINE_S)
    refused = ASKED[0]
    assert not refused.ok and refused.reason == "budget-exceeded", refused
    assert ("the token budget of run boss has 400 of 1,000 tokens left; this call reserves "
            "600") in refused.error, refused.error

    GATES["hog"].set()
    await eventually(lambda: boss_holding(0, 2), timeout=DEADLINE_S)
    GATES["retry"].set()
    boss = await stack.state("boss")

    async def nested_running():
        state = (await stack.tether.read_run(boss.as_parent(), "nested")).state
        return state.status == "running" and (state.turn > 1 or state.rewinds) and state

    await eventually(nested_running, timeout=DEADLINE_S)
    # Its new turn holds a share of the budget above it, as a fresh nested run would: what
    # it uses (a step of 100 tokens, charged as it is made) counts against it.
    boss = await eventually(lambda: boss_holding(SHARE - 100, 2), timeout=DEADLINE_S)
    assert spending.left(boss) == (1_000 - 100 - SHARE, None)

    GATES["turn"].set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == [kind == "follow-up", True,
                                           [False, True]], result
    boss = await eventually(lambda: boss_holding(0, 2), timeout=DEADLINE_S)
    assert spending.spent(boss).tokens == 200


class Quick(ChildAgent):
    """A budget of 1,000 tokens: a Chatty, and a follow-up of it as soon as it answers."""

    max_tokens = 1_000

    async def run(self, ctx: RunContext, input: Any) -> list:
        first = await ctx.run_agent_tool("Chatty", {}, run_id="nested")
        second = await ctx.run_agent_tool("Chatty", {"n": 2}, follow_up="nested")
        return [first.ok, second.ok]


@pytest.fixture
async def unsettled(settings, log, pool) -> AsyncIterator[Stack]:
    """No reconciler until the test starts one: nothing settles a turn that ended."""
    GATES.clear()
    GATES.update(turn=asyncio.Event())
    async with running_stack(settings, log, pool, [Chatty, Quick]) as started:
        try:
            yield started
        finally:
            GATES["turn"].set()


async def test_a_follow_up_asked_before_its_last_turn_was_settled_holds_its_share(unsettled):
    stack = unsettled
    call = asyncio.create_task(stack.parent.run_agent_tool("Quick", {}, run_id="quick"))

    async def turn_two_running():
        quick = await stack.state("quick")
        nested = None if quick is None else (
            await stack.tether.read_run(quick.as_parent(), "nested")).state
        return nested is not None and nested.turn == 2 and nested.status == "running"

    await eventually(turn_two_running, timeout=DEADLINE_S)
    # The parent settled the first turn (100 tokens) as it reserved the second's share.
    quick = await stack.state("quick")
    assert (spending.spent(quick).tokens, spending.reserved(quick).tokens) == (100, SHARE)

    await stack.start_reconciler()  # it settles the first turn late, then sees the second

    async def held_while_charged():
        quick = await stack.state("quick")
        (share,) = quick.spending.values()
        return (spending.spent(quick).tokens == 200 and not share.released
                and spending.reserved(quick).tokens == SHARE - 100 and quick)

    await eventually(held_while_charged, timeout=DEADLINE_S)
    GATES["turn"].set()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == [True, True], result
