"""A child that is steered, for services a test starts as processes (TETHER_AGENTS):
it takes the parent's first message in and keeps it in a step (milestone `heard`), then
waits for the next message and answers with both."""

from pydantic import BaseModel

from tether import ChildAgent, RunContext


class Nothing(BaseModel):
    pass


class Listener(ChildAgent):
    input_model = Nothing

    async def between(self) -> None:
        """What it awaits between the two messages (a test's gate)."""

    async def run(self, ctx: RunContext, input: Nothing) -> str:
        steps = ctx.history.steps if ctx.history is not None else {}
        if 0 in steps:
            first = steps[0]["text"]
        else:
            message = await ctx.next_message()
            first = message.text
            await ctx.record_step(0, {"text": first})
        await ctx.report_progress(milestone="heard", message=f"heard {first}")
        await self.between()
        second = await ctx.next_message()
        return f"{first} + {second.text}"
