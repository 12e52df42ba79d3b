"""A child that is itself a parent: it delegates each part of its input to a Summarizer.

Its nested runs are owned by `Coordinator/<its run id>`, so they appear on that
timeline, not on the timeline of whoever started the Coordinator, and the Coordinator
has its own cap on concurrent agent tools.
"""

from pydantic import BaseModel, Field

from tether import ChildAgent, RunContext


class CoordinateInput(BaseModel):
    parts: list[str] = Field(min_length=1, max_length=20)


class Coordinator(ChildAgent):
    description = "Summarises each part through a Summarizer child, one at a time"
    input_model = CoordinateInput
    max_concurrent_agent_tools = 1

    async def run(self, ctx: RunContext, input: CoordinateInput) -> str:
        summaries = []
        for index, part in enumerate(input.parts):
            result = await ctx.run_agent_tool("Summarizer", {"text": part},
                                              run_id=f"{ctx.run_id}-part-{index}")
            if not result.ok:
                raise RuntimeError(f"part {index} failed: {result.error}")
            summaries.append(result.summary)
            await ctx.report_progress(fraction=(index + 1) / len(input.parts))
        return " | ".join(summaries)
