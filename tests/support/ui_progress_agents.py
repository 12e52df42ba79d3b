"""A child for the UI's browser tests that reports half its progress, then completes: its
last reported fraction is 0.5 when it completes. The services import this module from
tests/support (PYTHONPATH)."""

from pydantic import BaseModel

from tether import ChildAgent, RunContext


class HalfwayInput(BaseModel):
    pass


class Halfway(ChildAgent):
    description = "Reports 50 % done, then completes"
    input_model = HalfwayInput

    async def run(self, ctx: RunContext, input: HalfwayInput) -> str:
        await ctx.report_progress(fraction=0.5, message="half", persist=True)
        return "done halfway"
