"""W1's child and finish hook as Restate handlers, served by the SDK's ASGI app.

`bench.peers.restate_w1` serves `app` with hypercorn in SDK worker processes and
registers them with its Restate server; this module is what those workers import.

- `W1Child`, a virtual object keyed by the run's id: its exclusive handler `run` sets
  the run's progress (state `progress`, each of the 5 values journaled: Restate has no
  ephemeral channel; without the wall-clock time Tether's bench child puts in each
  signal for its latency probe, since a handler must set the same values when Restate
  replays it), its milestones (state `milestones`, the list so far), does the
  work in a journaled step (`ctx.run_typed`), and, when asked, sends the finish hook a
  one-way message.
- The finish hook: `W1Hook.finished` (a plain service) or `W1HookObject.finished` (a
  virtual object keyed by the run's id). Its body is the application's own code run
  when a run is done, as the Tether bench app's hook handler is: it tells the driver
  with one line on a Unix socket connection to it (`TETHER_BENCH_RESTATE_DRIVER_SOCKET`),
  one connection per worker process. A stream drops nothing and a full one makes only
  the handler that writes wait (a UDP datagram on loopback is dropped when the driver's
  queue is full, which lost runs at 5,000; a Unix datagram blocks the whole process).
"""

import asyncio
import json
import os

import restate

PROGRESS_SIGNALS = 5
MILESTONES = ("half-way", "finished-work")

_driver = os.environ.get("TETHER_BENCH_RESTATE_DRIVER_SOCKET", "")
_connection: asyncio.StreamWriter | None = None
_connecting = asyncio.Lock()

child = restate.VirtualObject("W1Child")
hook_service = restate.Service("W1Hook")
hook_object = restate.VirtualObject("W1HookObject")


async def work(n: int) -> str:
    return f"bench run {n} done"


async def _tell_driver(request: dict) -> None:
    global _connection
    async with _connecting:
        if _connection is None:
            _, _connection = await asyncio.open_unix_connection(_driver)
    _connection.write(json.dumps({"n": request["n"], "run": request["run"]}).encode() + b"\n")
    await _connection.drain()


# The application's code is a journaled step: a hook invocation retried after its step
# was recorded does not run it again (Tether's hook handler keeps its delivery record).
@hook_service.handler()
async def finished(ctx: restate.Context, request: dict) -> None:
    await ctx.run_typed("tell the application", _tell_driver, request=request)


@hook_object.handler("finished")
async def finished_keyed(ctx: restate.ObjectContext, request: dict) -> None:
    await ctx.run_typed("tell the application", _tell_driver, request=request)


@child.handler()
async def run(ctx: restate.ObjectContext, request: dict) -> str:
    n = request["n"]
    milestones: list[str] = []
    for i in range(1, PROGRESS_SIGNALS + 1):
        ctx.set("progress", {"fraction": i / PROGRESS_SIGNALS, "phase": "working", "i": i})
        if i == 3:
            milestones.append(MILESTONES[0])
            ctx.set("milestones", milestones)
    result = await ctx.run_typed("work", work, n=n)
    milestones.append(MILESTONES[1])
    ctx.set("milestones", milestones)
    hook = request.get("hook")
    if hook == "service":
        ctx.service_send(finished, {"n": n, "run": ctx.key(), "result": result})
    elif hook == "object":
        ctx.object_send(finished_keyed, ctx.key(), {"n": n, "run": ctx.key(), "result": result})
    return result


app = restate.app([child, hook_service, hook_object])
