"""What the budget tests share: gates their agents wait on, what their parents were
answered, and a sibling that holds a share of the budgets above it."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext

GATES: dict[str, asyncio.Event] = {}  # each test makes its own (and clears them first)
ASKED: list[Any] = []  # the answers a parent agent got, in order


class Hog(ChildAgent):
    """Reserves 500 tokens of the budgets above it and holds them until its gate opens."""

    estimated_tokens = 500

    async def run(self, ctx: RunContext, input: Any) -> str:
        await GATES["hog"].wait()
        return "hogged"


class Leaf(ChildAgent):
    """Reserves 300 tokens of the budgets above it, until its gate opens."""

    estimated_tokens = 300

    async def run(self, ctx: RunContext, input: Any) -> str:
        await GATES["leaf"].wait()
        return "leafed"


class Far(ChildAgent):
    """A budget of 1,000 tokens: a Hog (500) and a Near (400) at once."""

    max_tokens = 1_000

    async def run(self, ctx: RunContext, input: Any) -> list:
        results = await asyncio.gather(ctx.run_agent_tool("Hog", {}, run_id="hog"),
                                       ctx.run_agent_tool("Near", {}, run_id="near"))
        return [r.ok for r in results]


@asynccontextmanager
async def gated_stack(settings, log, pool, agents: list[type[ChildAgent]],
                      gates: tuple[str, ...]) -> AsyncIterator[Stack]:
    """The services with the reconciler, running `agents`, and `gates` closed (all opened
    as it stops, so no agent waits on)."""
    GATES.clear()
    GATES.update({name: asyncio.Event() for name in gates})
    ASKED.clear()
    async with running_stack(settings, log, pool, agents, reconciler=True) as started:
        try:
            yield started
        finally:
            for gate in GATES.values():
                gate.set()
