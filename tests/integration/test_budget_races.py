"""Two requests for one run id under two budgets, over real NATS and Postgres: the one
refused by the farther budget must not free the nearer share the other reserved, or
the run the other starts would run unreserved at the nearer budget."""

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest
from eventually import eventually
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.domain import spending
from tether.domain.amounts import Amount
from tether.domain.decide import Cause
from tether.domain.events import RunRef

DEADLINE_S = 30
GATES: dict[str, asyncio.Event] = {}
ASKED: list[Any] = []


class Hog(ChildAgent):
    """Reserves 500 tokens of the budgets above it until its gate opens."""

    estimated_tokens = 500

    async def run(self, ctx: RunContext, input: Any) -> str:
        await GATES["hog"].wait()
        return "hogged"


class Leaf(ChildAgent):
    """Reserves 300 tokens of the budgets above it."""

    estimated_tokens = 300

    async def run(self, ctx: RunContext, input: Any) -> str:
        return "leafed"


class Near(ChildAgent):
    """A budget of 400 tokens below Far's: asks for the Leaf `leaf` when its gate opens."""

    max_tokens = 400

    async def run(self, ctx: RunContext, input: Any) -> str:
        await GATES["ask"].wait()
        ASKED.append(await ctx.run_agent_tool("Leaf", {}, run_id="leaf"))
        return "asked"


class Far(ChildAgent):
    """A budget of 1,000 tokens: a Hog (500) and a Near (400) at once."""

    max_tokens = 1_000

    async def run(self, ctx: RunContext, input: Any) -> list:
        results = await asyncio.gather(ctx.run_agent_tool("Hog", {}, run_id="hog"),
                                       ctx.run_agent_tool("Near", {}, run_id="near"))
        return [r.ok for r in results]


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    GATES.clear()
    GATES.update(hog=asyncio.Event(), ask=asyncio.Event())
    ASKED.clear()
    async with running_stack(settings, log, pool, [Hog, Leaf, Near, Far],
                             reconciler=True) as started:
        try:
            yield started
        finally:
            for gate in GATES.values():
                gate.set()


async def test_a_request_refused_further_up_leaves_the_nearer_share_another_request_holds(
        stack):
    call = asyncio.create_task(stack.parent.run_agent_tool("Far", {}, run_id="far"))

    async def near_running():
        far = await stack.state("far")
        near = None if far is None else (
            await stack.tether.read_run(far.as_parent(), "near")).state
        return (near is not None and near.status == "running"
                and spending.reserved(far).tokens == 900 and near)

    near = await eventually(near_running, timeout=DEADLINE_S)
    leaf = RunRef(parent=near.as_parent(), run_id="leaf")
    # Another request for the Leaf (a second parent replica's, say) has reserved its share
    # of Near's budget, and has yet to reserve Far's.
    other = Cause(command_seq=1_000_000, now=near.requested_at)
    _, appended = await stack.log.update(near.parent, near.run_id, partial(
        spending.reserve, run=leaf, amount=Amount(tokens=300), cause=other))
    assert appended

    GATES["ask"].set()  # this request finds it held at Near's, and Far has 100 left
    await eventually(lambda: ASKED, timeout=DEADLINE_S)
    refused = ASKED[0]
    assert not refused.ok and refused.reason == "budget-exceeded", refused

    near = (await stack.tether.read_run(near.parent, near.run_id)).state
    assert spending.holds(near, leaf), near.spending
    assert spending.reserved(near).tokens == 300
    GATES["hog"].set()
    assert (await asyncio.wait_for(call, DEADLINE_S)).ok
