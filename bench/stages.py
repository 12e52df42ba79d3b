"""Where a run's time goes: the hops between its events, from their `occurred_at`.

For a sample of runs, the time from the request to each milestone of the run's life as
the services stamped it (ms resolution, one machine so one clock), and from the last
event to the application seeing the end (the awaited return or the finish hook):

    request -> requested   the parent picked the command up, decided, and (right after)
                           put the work on the queue
    requested -> running   a child-runner took the work and began
    running -> completed   the child ran: progress, milestones, outcome appended
    completed -> app       the awaiting client / the finish hook saw the end

and, for detached runs, the finish hook's two legs: `completed -> hook published` (the
parent's delivery put it on the hooks stream: the message's stream timestamp) and
`hook published -> app` (the application's handler was called).
"""

import asyncio
import json

from nats.js import api as js_api

from bench.stats import percentile
from tether.client import Tether
from tether.domain.events import ParentRef

STAGES = (("request->requested", None, "run.requested"),
          ("requested->running", "run.requested", "run.running"),
          ("running->completed", "run.running", "run.completed"))


async def hook_times(tether: Tether, expected: int) -> dict[str, float]:
    """run id -> when its finish hook entered the hooks stream (epoch seconds)."""
    times: dict[str, float] = {}
    done = asyncio.Event()

    async def on_message(msg) -> None:
        try:
            run_id = json.loads(msg.data)["run"]["run_id"]
        except (ValueError, KeyError, TypeError):
            return
        times.setdefault(run_id, msg.metadata.timestamp.timestamp())
        if len(times) >= expected or msg.metadata.num_pending == 0:
            done.set()

    subjects = tether.subjects
    subscription = await tether.js.subscribe(
        f"{subjects.prefix}.hook.>", stream=subjects.hooks_stream, cb=on_message,
        ordered_consumer=True, config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL))
    try:
        await asyncio.wait_for(done.wait(), 30)
    except TimeoutError:
        pass
    await subscription.unsubscribe()
    return times


async def breakdown(tether: Tether, runs: list[tuple[ParentRef, str, float, float]],
                    sample: int = 200, hooks: dict[str, float] | None = None) -> dict:
    """runs: (parent, run id, request time, time the app saw the end), epoch seconds;
    hooks: run id -> time its finish hook was published (detached runs)."""
    step = max(len(runs) // sample, 1)
    chosen = runs[::step][:sample]
    hops: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    hops["completed->app"] = []
    if hooks is not None:
        hops["completed->hook published"] = []
        hops["hook published->app"] = []
    hops["total"] = []

    async def one(parent: ParentRef, run_id: str, requested: float, seen: float) -> None:
        history = await tether.log.read_run(parent, run_id)
        at = {}
        for event in history.events:
            at.setdefault(event.type, event.occurred_at / 1000)
        for name, begin, end in STAGES:
            start = requested if begin is None else at.get(begin)
            if start is not None and end in at:
                hops[name].append(at[end] - start)
        if "run.completed" in at:
            hops["completed->app"].append(seen - at["run.completed"])
            if hooks is not None and run_id in hooks:
                hops["completed->hook published"].append(hooks[run_id] - at["run.completed"])
                hops["hook published->app"].append(seen - hooks[run_id])
        hops["total"].append(seen - requested)

    semaphore = asyncio.Semaphore(16)

    async def limited(*args) -> None:
        async with semaphore:
            await one(*args)

    await asyncio.gather(*(limited(*run) for run in chosen))
    return {name: {"p50_ms": percentile(values, 50) * 1000, "p99_ms": percentile(values, 99) * 1000,
                   "count": len(values)} for name, values in hops.items()}


def render(stages: dict) -> str:
    return "; ".join(f"{name} {v['p50_ms']:.1f}/{v['p99_ms']:.1f}" for name, v in stages.items())
