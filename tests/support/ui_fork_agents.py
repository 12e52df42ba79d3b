"""A child for the UI's browser tests of forks: three recorded steps, each naming the run
that made it, so a fork's own steps part from its original's where it was forked. The
services import this module from tests/support (PYTHONPATH)."""

from typing import Any

from tether import ChildAgent, RunContext


class Stepper(ChildAgent):
    description = "Records three steps, then completes"

    async def run(self, ctx: RunContext, input: Any) -> str:
        done = ctx.history.steps if ctx.history is not None else {}
        for index in range(3):
            if index not in done:
                await ctx.record_step(index, {"step": index, "by": ctx.run_id})
        return f"three steps, the last by {ctx.run_id}"
