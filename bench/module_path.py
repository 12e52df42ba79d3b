"""The modules of libs/tether one W1 run passes through, from `run_agent_tool` to the finish
hook handled: how many, and how often the path goes back to one it left.

    python scripts/devstack.py test -- python -m bench.module_path [--show]

The parent service, a child-runner (the bench child) and the application run in this
process, on the servers of `TETHER_NATS_URL` and `TETHER_DATABASE_URL`, under a fresh
prefix and schema. After a warm-up run, one detached run with a finish hook is traced:
every call into a module of `tether` (a coroutine's resumptions are not new calls),
per asyncio task, consecutive calls within one module counted once. A *return* is a task
entering a module again after it left it for another; an *upward call* is a call from a
module into one of a higher layer (`libs/tether/layers.toml`): a callback or a closure
handed down, the path climbing back up.
"""

import argparse
import asyncio
import sys
import tomllib
import uuid
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg

from bench.agents import BenchChild
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.migrator import migrate
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.agent_registry import AgentRegistry
from tether.client import connect
from tether.config import Settings
from tether.log import get_logger
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent

PARENT_AGENT = "Bench"
LAYERS = tomllib.loads((Path(__file__).parents[1] / "libs/tether/layers.toml").read_text())
LAYER_OF = {package: index for index, layer in enumerate(LAYERS["layer"])
            for package in layer["packages"]}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF.get(parts[1] if len(parts) > 1 else "tether", len(LAYER_OF))


class PathTracer:
    """Per task, the tether modules entered, in order, consecutive repeats folded."""

    def __init__(self) -> None:
        self.paths: dict[int, list[str]] = {}
        self.upward: Counter[tuple[str, str]] = Counter()
        self.reentries: Counter[tuple[str, str]] = Counter()
        self._started: set[int] = set()
        self.recording = False

    def __call__(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("tether"):
            return
        if frame.f_code.co_flags & 0x380:  # a coroutine or generator: count its start only
            if id(frame) in self._started:
                return
            self._started.add(id(frame))
        if not self.recording:  # the warm-up: only the loops already running are noted
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        path = self.paths.setdefault(id(task), [])
        if not path or path[-1] != module:
            path.append(module)
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller != module and _below(frame.f_back, module):
            self.reentries[(caller, module)] += 1
        if (caller.startswith("tether.") and caller.split(".")[1] != module.split(".")[1]
                and layer(module) > layer(caller)):
            self.upward[(caller, module)] += 1


def _below(frame: FrameType | None, module: str) -> bool:
    """Whether `module` is on the stack under `frame` (its caller's caller, or further):
    a call from `frame` into it goes back into a module the path had left for this one."""
    frame = frame.f_back if frame is not None else None
    while frame is not None:
        if frame.f_globals.get("__name__", "") == module:
            return True
        frame = frame.f_back
    return False


def summary(paths: dict[int, list[str]]) -> tuple[set[str], int, Counter[str]]:
    modules: set[str] = set()
    returns: Counter[str] = Counter()
    for path in paths.values():
        seen: set[str] = set()
        for module in path:
            if module in seen:
                returns[module] += 1
            seen.add(module)
        modules |= seen
    return modules, sum(returns.values()), returns


async def main(show: bool) -> int:
    base = Settings.from_env()
    name = "mp" + uuid.uuid4().hex[:8]
    settings = Settings(**{**base.model_dump(), "prefix": name, "projection_schema": name})
    nc = await connect_nats(settings.nats_url, name="module-path",
                            fast_path=settings.nats_fast_path)
    js = nc.jetstream()
    await ensure_streams(js, settings.subjects, StreamSettings())
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=4)
    async with pool.acquire() as conn:
        await migrate(conn, settings.projection_schema)
    registry = AgentRegistry([BenchChild])
    runner = await open_runner(nc, settings, registry, fetch_timeout_s=0.3)
    parent = await open_parent(settings, EventLog(nc, settings.subjects), pool, registry,
                           get_logger(service="module-path"))
    stop = asyncio.Event()
    tracer = PathTracer()
    # Profiled from the services' start, so that a loop started before the traced run (a
    # fetch loop) is known when it resumes, not taken for a new call.
    sys.setprofile(tracer)
    services = [asyncio.create_task(runner.run(stop)), asyncio.create_task(parent.run(stop))]
    try:
        async with connect(settings=settings) as tether:
            handled = asyncio.Queue[str]()
            hooks = tether.hooks(PARENT_AGENT)
            hooks.register("on_done", lambda run, result: handled.put_nowait(run.run_id))
            async with hooks.running():
                me = tether.parent(PARENT_AGENT, "user-1")
                for traced in (False, True):
                    tracer.recording = traced
                    await me.run_agent_tool("BenchChild", {"n": int(traced)},
                                            detached={"on_finish": "on_done"})
                    await asyncio.wait_for(handled.get(), 30)
                sys.setprofile(None)
    finally:
        sys.setprofile(None)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*services, return_exceptions=True), 10)
        await remove_streams(js, settings.subjects)
        await pool.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}" CASCADE')
        await pool.close()
        await nc.drain()
    modules, returns, by_module = summary(tracer.paths)
    print(f"{len(modules)} modules of tether entered by {len(tracer.paths)} tasks; "
          f"{returns} returns to a module a task had left; "
          f"{sum(tracer.upward.values())} upward calls along {len(tracer.upward)} edges; "
          f"{sum(tracer.reentries.values())} calls back into a module on the stack along "
          f"{len(tracer.reentries)} edges")
    if show:
        for (caller, module), count in sorted(tracer.reentries.items()):
            print(f"  back: {caller} -> {module} ({count}x)")
        for (caller, module), count in sorted(tracer.upward.items()):
            print(f"  up: {caller} -> {module} ({count}x)")
        for module in sorted(modules):
            print(f"  {module}" + (f"  (returned to {by_module[module]}x)"
                                   if by_module[module] else ""))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.module_path")
    parser.add_argument("--show", action="store_true", help="list the modules")
    sys.exit(asyncio.run(main(parser.parse_args().show)))
