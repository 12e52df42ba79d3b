"""Child agents the gateway's tests serve (`TETHER_AGENTS=gateway_agents:...`)."""

import asyncio

from pydantic import BaseModel, Field

from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.context import RunContext

# Set by a test to let `Held`, `HeldResearcher` and `Streamer` runs go on (they run in the
# test's own runner); the test's fixture makes a new one for its event loop.
RELEASE = asyncio.Event()


class Question(BaseModel):
    query: str = Field(min_length=1, description="what to look into")


class Researcher(ChildAgent):
    description = "Looks a question up and says what it found"
    input_model = Question

    async def run(self, ctx: RunContext, input: Question) -> str:
        await ctx.report_progress(fraction=0.3, message="reading sources")
        await ctx.report_progress(milestone="sources-gathered", fraction=0.6)
        return f"{input.query}: two sources agree"


class HeldResearcher(Researcher):
    """A `Researcher` that starts once the test releases it, so a stream that starts it
    sees the run go on from there."""

    description = "Looks a question up once the test lets it go on"

    async def run(self, ctx: RunContext, input: Question) -> str:
        await RELEASE.wait()
        return await super().run(ctx, input)


class Waiter(ChildAgent):
    description = "Waits until it is cancelled"

    async def run(self, ctx: RunContext, input: dict) -> str:
        await ctx.report_progress(fraction=0.1, message="waiting")
        await ctx.cancelled.wait()
        ctx.raise_if_cancelled()
        return "never"


class Failing(ChildAgent):
    description = "Always fails"

    async def run(self, ctx: RunContext, input: dict) -> str:
        raise RuntimeError("the source is down")


class Held(ChildAgent):
    description = "Finishes once the test releases it"

    async def run(self, ctx: RunContext, input: dict) -> str:
        await ctx.report_progress(fraction=0.5, message="held")
        await RELEASE.wait()
        return "released"


class Approver(ChildAgent):
    description = "Publishes once a human approves"

    async def run(self, ctx: RunContext, input: dict) -> str | AwaitingInput:
        resumptions = ctx.history.resumptions if ctx.history else []
        if not resumptions:
            return AwaitingInput("waiting_for_human", key="publish", pending=[
                {"tool_call_id": "publish", "tool_name": "publish", "input": {},
                 "reason": "approval"}])
        approved = "publish" in resumptions[-1].decisions.get("approvals", [])
        return "published" if approved else "not published"


class Streamer(ChildAgent):
    """Writes one piece of output, waits for the test, writes another."""

    description = "Writes its output in two pieces"

    async def run(self, ctx: RunContext, input: dict) -> str:
        await ctx.output("first piece. ")
        await RELEASE.wait()
        await ctx.output("second piece.")
        return "streamed"


class Asker(ChildAgent):
    """Waits for the output of a search run outside it, and says what it got."""

    description = "Waits for a search's output from outside"

    async def run(self, ctx: RunContext, input: dict) -> str | AwaitingInput:
        resumptions = ctx.history.resumptions if ctx.history else []
        if not resumptions:
            return AwaitingInput("waiting_for_tools", key="search", pending=[
                {"tool_call_id": "search", "tool_name": "search", "input": {"q": "tether"},
                 "reason": "external"}])
        decisions = resumptions[-1].decisions
        if "search" in decisions.get("rejections", []):
            return "the search was rejected"
        return f"found {decisions.get('tool_outputs', {}).get('search')}"
