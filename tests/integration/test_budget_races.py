"""Two requests for one run id under two budgets, over real NATS and Postgres: the one
refused by the farther budget must not free the nearer share the other reserved or
claimed, or the run the other starts would run unreserved at the nearer budget; and a
request whose first delivery reserved the nearer share before its parent died frees it
when the next delivery is refused further up.

The interleavings are forced: the requests' handler (`RunRequests`, the parent's own)
runs in the test over the test's log, which holds a request before its decision on the
farther budget until the test lets it go on."""

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
import pytest
from budget_agents import ASKED, GATES, Far, Hog, Leaf, gated_stack
from eventually import eventually
from runner_stack import Stack

from tether import ChildAgent, RunContext
from tether.domain import decide, spending
from tether.domain.amounts import Amount
from tether.domain.decide import Cause
from tether.domain.events import RunRef
from tether.domain.run_state import RunState
from tether.parent.run_requests import RunOutcome, RunRequests

DEADLINE_S = 30


class Near(ChildAgent):
    """A budget of 400 tokens below Far's: asks for the Leaf `leaf` when its gate opens."""

    max_tokens = 400

    async def run(self, ctx: RunContext, input: Any) -> str:
        await GATES["ask"].wait()
        ASKED.append(await ctx.run_agent_tool("Leaf", {}, run_id="leaf"))
        return "asked"


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    async with gated_stack(settings, log, pool, [Hog, Leaf, Near, Far],
                           ("hog", "ask", "leaf")) as started:
        yield started


async def near_running(stack: Stack) -> RunState:
    """Near, running below Far, once Far holds Hog's share and Near's (100 of its 1,000
    tokens left)."""
    async def running():
        far = await stack.state("far")
        near = None if far is None else (
            await stack.tether.read_run(far.as_parent(), "near")).state
        return (near is not None and near.status == "running"
                and spending.reserved(far).tokens == 900 and near)

    return await eventually(running, timeout=DEADLINE_S)


class ParentDied(Exception):
    pass


class HeldBeforeFar:
    """The parent's event log, holding a request before its decision on Far's budget
    until the test lets it go on (`go`), or dying there (`dies`)."""

    def __init__(self, log, *, dies: bool = False) -> None:
        self._log, self._dies = log, dies
        self.recent = self
        self.reached, self.go = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    async def update(self, parent, run_id: str, decision):
        if run_id == "far" and not self.go.is_set():
            self.reached.set()
            if self._dies:
                raise ParentDied
            await self.go.wait()
        return await self._log.recent.update(parent, run_id, decision)

    async def update_at(self, parent, run_id: str, decision):
        return await self._log.recent.update_at(parent, run_id, decision)


def leaf_requests(stack: Stack, log) -> RunRequests:
    """The parent's handler of `run` commands over `log`."""
    async def registered(agent: str, method: str) -> bool:
        return True

    settings = stack.settings
    return RunRequests(log, stack.registry,
                       budgets=decide.Budgets(settings.detached_max_budget_ms,
                                              settings.detached_no_progress_budget_ms),
                       slots=None, default_cap=None, max_input_bytes=settings.max_input_bytes,
                       hook_registered=registered)


def leaf_request(near: RunState) -> dict[str, Any]:
    """Near's request of the Leaf `leaf`, as its `RunContext` sends it."""
    return {"type": "run", "run_id": "leaf", "parent": msgspec.to_builtins(near.as_parent()),
            "agent_type": "Leaf", "input": {},
            "started_by": {"parent": msgspec.to_builtins(near.parent), "run_id": near.run_id}}


async def reserved_for_leaf(stack: Stack, near: RunState) -> int:
    near = (await stack.tether.read_run(near.parent, near.run_id)).state
    leaf = RunRef(parent=near.as_parent(), run_id="leaf")
    return spending.reserved(near).tokens if spending.holds(near, leaf) else 0


async def test_a_request_refused_further_up_frees_the_nearer_share_its_dead_delivery_reserved(
        stack):
    """The parent reserved the Leaf's share of Near's budget and died before Far's: the
    command's next delivery finds the share held, and Far (100 tokens left) refuses it.
    The share is its own: freed, not held with no run behind it."""
    call = asyncio.create_task(stack.parent.run_agent_tool("Far", {}, run_id="far"))
    near = await near_running(stack)
    seq = 2_000_001  # the command's stream sequence, the same in each of its deliveries

    dying = HeldBeforeFar(stack.log, dies=True)
    with pytest.raises(ParentDied):
        await leaf_requests(stack, dying).run(leaf_request(near), seq)
    assert await reserved_for_leaf(stack, near) == 300

    again = await leaf_requests(stack, stack.log).run(leaf_request(near), seq)

    assert again == RunOutcome("rejected", code="budget-exceeded")
    assert await reserved_for_leaf(stack, near) == 0
    for gate in GATES.values():
        gate.set()
    assert (await asyncio.wait_for(call, DEADLINE_S)).ok


async def test_a_request_relying_on_a_share_another_request_reserved_keeps_it_held(stack):
    """Request A reserves the Leaf's share of Near's budget; request B, for the same run
    id, finds it held; Far (100 tokens left) refuses A, which frees what it claims; Hog
    ends, and Far has room for B, which starts the Leaf: Near must still hold its share."""
    call = asyncio.create_task(stack.parent.run_agent_tool("Far", {}, run_id="far"))
    near = await near_running(stack)
    far = await stack.state("far")
    log_a, log_b = HeldBeforeFar(stack.log), HeldBeforeFar(stack.log)
    request_a = asyncio.create_task(leaf_requests(stack, log_a).run(leaf_request(near),
                                                                    3_000_001))
    await asyncio.wait_for(log_a.reached.wait(), DEADLINE_S)
    request_b = asyncio.create_task(leaf_requests(stack, log_b).run(leaf_request(near),
                                                                    3_000_002))
    await asyncio.wait_for(log_b.reached.wait(), DEADLINE_S)

    log_a.go.set()
    assert await asyncio.wait_for(request_a, DEADLINE_S) == RunOutcome(
        "rejected", code="budget-exceeded")
    GATES["hog"].set()

    async def far_has_room():
        state = (await stack.tether.read_run(far.parent, far.run_id)).state
        return spending.reserved(state).tokens == 400

    await eventually(far_has_room, timeout=DEADLINE_S)
    log_b.go.set()

    assert await asyncio.wait_for(request_b, DEADLINE_S) == RunOutcome("created",
                                                                       status="starting")
    assert await reserved_for_leaf(stack, near) == 300
    GATES["ask"].set()
    GATES["leaf"].set()
    assert (await asyncio.wait_for(call, DEADLINE_S)).ok


async def test_a_request_refused_further_up_leaves_the_nearer_share_another_request_holds(
        stack):
    call = asyncio.create_task(stack.parent.run_agent_tool("Far", {}, run_id="far"))
    near = await near_running(stack)
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
