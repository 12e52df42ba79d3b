"""A child for the UI's browser tests of forks: three recorded steps, each naming the run
that made it, so a fork's own steps part from its original's where it was forked. The
services import this module from tests/support (PYTHONPATH)."""

import asyncio
from pathlib import Path
from typing import Any

from tether import ChildAgent, RunContext


class Stepper(ChildAgent):
    description = "Records three steps, then completes"

    async def run(self, ctx: RunContext, input: Any) -> str:
        done = ctx.history.steps if ctx.history is not None else {}
        # `hold_while` (an extra field of `AnyInput`): a file that, while it is there,
        # holds the last step back.
        hold_while = getattr(input, "hold_while", None)
        hold = Path(hold_while) if hold_while else None
        for index in range(3):
            if index not in done:
                # The test's process and the child-runner's share no event to wait on.
                while index == 2 and hold is not None and hold.exists():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                await ctx.record_step(index, {"step": index, "by": ctx.run_id})
        return f"three steps, the last by {ctx.run_id}"
