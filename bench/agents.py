"""The child agent of the benchmark: 5 ephemeral progress signals, 2 milestones, done.

No sleeps: the run costs only what Tether does around it. Every signal carries the
wall-clock time of the `report_progress` call in `data.t` (seconds, float), so a
subscriber on the progress subjects measures report-to-receive latency without the
millisecond rounding (and the +1 ms monotonic bump) of `ProgressSignal.at`.

The runner coalesces ephemeral progress (one signal per 200 ms per run, `fraction >= 1`
at once), so of the 5 signals a subscriber typically sees the 1st, the pending one
flushed by each milestone, and the last: latency is measured on the signals that are
actually published, from the moment their value was reported.
"""

import time

from pydantic import BaseModel

from tether.child.agent import ChildAgent
from tether.child.context import RunContext

PROGRESS_SIGNALS = 5
MILESTONES = ("half-way", "finished-work")


class BenchInput(BaseModel):
    n: int = 0


class BenchChild(ChildAgent):
    description = "Benchmark child: 5 progress signals and 2 milestones, then completes"
    input_model = BenchInput

    async def run(self, ctx: RunContext, input: BenchInput) -> str:
        for i in range(1, PROGRESS_SIGNALS + 1):
            await ctx.report_progress(fraction=i / PROGRESS_SIGNALS, phase="working",
                                      data={"t": time.time(), "i": i})
            if i == 3:
                await ctx.report_progress(milestone=MILESTONES[0], fraction=0.6,
                                          data={"t": time.time()})
        await ctx.report_progress(milestone=MILESTONES[1], data={"t": time.time()})
        return f"bench run {input.n} done"
