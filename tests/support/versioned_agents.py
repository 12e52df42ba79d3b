"""A child agent whose code version each process sets (`AGENT_VERSION`), as two
deployments of different code for one agent type would have. Loaded by the services a
test starts (PYTHONPATH)."""

import asyncio
import os

from pydantic import BaseModel

from tether.child.agent import ChildAgent
from tether.child.context import RunContext


class VersionedInput(BaseModel):
    seconds: float = 0  # how long the first attempt works; a resumed one ends at once


class Versioned(ChildAgent):
    description = "Works for a while, in the version of its code its process was given"
    input_model = VersionedInput
    version = os.environ.get("AGENT_VERSION", "")

    async def run(self, ctx: RunContext, input: VersionedInput) -> str:
        await ctx.report_progress(milestone="started", data={"version": self.version})
        if ctx.attempt == 1:  # long enough to be killed mid-run; its successor need not wait
            await asyncio.sleep(input.seconds)
        return f"ran version {self.version}"
