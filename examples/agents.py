"""Example child agents, used by the tests and the demo.

Run them with `tether services child-runner --agents examples.agents:Researcher,...`.
"""

import asyncio
import time
from typing import Any

from pydantic import BaseModel, Field

from tether.child.agent import ChildAgent
from tether.child.context import RunContext


class ResearchInput(BaseModel):
    query: str = Field(min_length=3, max_length=500)
    # Seconds between steps, so a demo has progress to watch (0: as fast as it goes).
    pace_s: float = Field(default=0.0, ge=0, le=60)


class Researcher(ChildAgent):
    """Progress, a milestone with data, streamed output, and a summary string."""

    description = "Researches a topic and summarises what the sources say"
    input_model = ResearchInput

    async def run(self, ctx: RunContext, input: ResearchInput) -> str:
        await ctx.report_progress(fraction=0.1, phase="searching",
                                  message=f"searching for {input.query}")
        await ctx.output(f"Searching the web for {input.query!r}.\n")
        await _pause(ctx, input.pace_s)
        await ctx.report_progress(fraction=0.5, phase="reading", message="3 of 6 sources")
        await _pause(ctx, input.pace_s)
        await ctx.report_progress(milestone="sources-gathered", fraction=0.6,
                                  data={"sources": 2})
        await _pause(ctx, input.pace_s)
        await ctx.output("Two sources agree; writing the summary.\n")
        await ctx.report_progress(fraction=1.0, phase="writing", message="done")
        return f"{input.query}: the two sources agree on the essentials."


async def _pause(ctx: RunContext, seconds: float) -> None:
    """Sleep, but wake up for a cancellation and stop there."""
    if seconds <= 0:
        return
    try:
        async with asyncio.timeout(seconds):
            await ctx.cancelled.wait()
    except TimeoutError:
        return
    ctx.raise_if_cancelled()


class ImportInput(BaseModel):
    source: str = Field(min_length=1, max_length=500)
    rows: int = Field(default=1000, ge=1, le=10_000_000)
    batch: int = Field(default=100, ge=1)
    pace_s: float = Field(default=0.0, ge=0, le=60)  # seconds per batch


class Importer(ChildAgent):
    """A long, detached kind of job: progress per batch and two milestones.

    On a resumed run it imports everything again; the runner keeps the milestones it
    already recorded from being recorded twice, and an idempotent load (upserts by key)
    keeps the rows right.
    """

    description = "Imports rows from a source in batches"
    input_model = ImportInput

    async def run(self, ctx: RunContext, input: ImportInput) -> dict[str, Any]:
        done = 0
        while done < input.rows:
            done = min(done + input.batch, input.rows)
            await _pause(ctx, input.pace_s)
            ctx.raise_if_cancelled()
            await ctx.report_progress(fraction=done / input.rows, phase="importing",
                                      message=f"{done:,} of {input.rows:,} rows")
            if done * 2 >= input.rows and done * 2 - input.batch * 2 < input.rows:
                await ctx.report_progress(milestone="half-imported", fraction=done / input.rows,
                                          data={"rows": done})
        await ctx.report_progress(milestone="rows-imported", fraction=1.0,
                                  data={"rows": input.rows})
        return {"source": input.source, "rows": input.rows}

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return f"imported {output['rows']:,} rows from {output['source']}"


class TextInput(BaseModel):
    text: str


class Summarizer(ChildAgent):
    """Quick and deterministic: the summary is the text upper-cased."""

    description = "Shouts the text back"
    input_model = TextInput

    async def run(self, ctx: RunContext, input: TextInput) -> str:
        return input.text.upper()


class FailingInput(BaseModel):
    message: str = "the child failed on purpose"


class Failing(ChildAgent):
    description = "Always raises"
    input_model = FailingInput

    async def run(self, ctx: RunContext, input: FailingInput) -> str:
        raise ValueError(input.message)


class SleepInput(BaseModel):
    seconds: float = Field(ge=0, le=3600)
    milestones: int = Field(default=0, ge=0, le=1000)


class Sleeper(ChildAgent):
    """Sleeps cooperatively, optionally passing a milestone per step.

    It stops within one small step of `ctx.cancelled`; on a resumed run it starts again
    from the beginning, and the runner keeps the milestones it passed before from being
    recorded twice.
    """

    description = "Sleeps for a while, reporting milestones step-1 .. step-N"
    input_model = SleepInput
    tick_s = 0.02

    async def run(self, ctx: RunContext, input: SleepInput) -> str:
        steps = max(input.milestones, 1)
        step_s = input.seconds / steps
        for step in range(1, steps + 1):
            deadline = time.monotonic() + step_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    async with asyncio.timeout(min(left, self.tick_s)):
                        await ctx.cancelled.wait()
                except TimeoutError:
                    continue
                ctx.raise_if_cancelled()
            if input.milestones:
                await ctx.report_progress(milestone=f"step-{step}", fraction=step / steps,
                                          data={"step": step})
        return f"slept {input.seconds:g}s"


class ExtractInput(BaseModel):
    text: str


class Extractor(ChildAgent):
    """Workflow-style: no final text; the output is rows, the summary a fixed sentence."""

    description = "Extracts `key: value` lines into rows"
    input_model = ExtractInput

    def __init__(self) -> None:
        self._rows: list[dict[str, str]] = []

    async def run(self, ctx: RunContext, input: ExtractInput) -> None:
        lines = [line for line in input.text.splitlines() if ":" in line]
        for number, line in enumerate(lines, start=1):
            key, _, value = line.partition(":")
            self._rows.append({"key": key.strip(), "value": value.strip()})
            await ctx.report_progress(fraction=number / len(lines), phase="extracting")

    async def get_output(self, run_id: str) -> Any:
        return {"rows": self._rows}

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return "Extraction complete"
