"""The child agents of the chaos scenarios (tests/chaos): each logs the start of its turn.

A `chaos.turn_started` line (run id, attempt, and when the runner let the turn start:
`ctx.started_at`) in the child-runner's log is what lets a scenario check that no child
turn started for a run that had moved on: an attempt superseded by a newer one, or a run
that had already ended.
"""

import asyncio

from pydantic import BaseModel, Field

from examples.agents import Researcher, ResearchInput
from tether.child.agent import ChildAgent
from tether.child.context import RunContext
from tether.log import get_logger


def log_turn_started(ctx: RunContext) -> None:
    get_logger().info("chaos.turn_started", run_id=ctx.run_id, attempt=ctx.attempt,
                      agent_type=ctx.agent_type, started_at=ctx.started_at)


class TracedResearcher(Researcher):
    """The Researcher, its turns logged."""

    async def run(self, ctx: RunContext, input: ResearchInput) -> str:
        log_turn_started(ctx)
        return await super().run(ctx, input)


class TickInput(BaseModel):
    seconds: float = Field(default=7.0, gt=0, le=600)
    every_s: float = Field(default=1.0, gt=0, le=60)


class Ticker(ChildAgent):
    """A well-behaved long child: a progress signal every `every_s`, for `seconds`.

    Its gaps between signals stay far below a no-progress budget of a few seconds, so
    such a budget must never give up on it.
    """

    description = "Reports progress at a steady pace for a while"
    input_model = TickInput

    async def run(self, ctx: RunContext, input: TickInput) -> str:
        log_turn_started(ctx)
        loop = asyncio.get_running_loop()
        started = loop.time()
        ticks = max(round(input.seconds / input.every_s), 1)
        for tick in range(1, ticks + 1):
            await ctx.report_progress(fraction=tick / ticks, phase="ticking",
                                      message=f"tick {tick} of {ticks}")
            # Paced from the start, so a slow report does not stretch the next gap.
            wake_at = started + tick * input.every_s
            try:
                async with asyncio.timeout_at(wake_at):
                    await ctx.cancelled.wait()
            except TimeoutError:
                continue
            ctx.raise_if_cancelled()
        return f"ticked {ticks} times"
