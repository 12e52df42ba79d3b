"""The Tether side of a test of child agents: the parent service in the test's process,
and child-runners the test starts and stops."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

from eventually import eventually

from tether.agent_registry import AgentRegistry
from tether.client import Tether, connect
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import DefaultFormatters
from tether.log import get_logger
from tether.reconciler.service import Reconciler
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent


class Stack:
    """The parent service in this process, and child-runners the test starts and stops
    (a stopped one gives its runs back, as on SIGTERM)."""

    def __init__(self, settings, log, pool, tether: Tether, agents: list) -> None:
        self.settings, self.log, self.pool, self.tether = settings, log, pool, tether
        self.registry = AgentRegistry(agents)
        self.stops: list[tuple[asyncio.Event, asyncio.Task]] = []
        self.parent = tether.parent("Assistant", "remote")

    async def start_parent(self) -> None:
        parent = await open_parent(self.settings, self.log, self.pool, self.registry,
                                   get_logger(service="parent-test"))
        stop = asyncio.Event()
        self.stops.append((stop, asyncio.create_task(parent.run(stop))))

    async def start_reconciler(self) -> Reconciler:
        """The reconciler in this process (budgets: give-ups, charges of usage)."""
        deliverer = await Deliverer.open(self.settings, self.log, DefaultFormatters(),
                                         get_logger(service="reconciler-test"))
        reconciler = Reconciler(self.settings, self.log, self.pool, deliverer,
                                get_logger(service="reconciler-test"))
        stop = asyncio.Event()
        self.stops.append((stop, asyncio.create_task(reconciler.run(stop))))
        await asyncio.wait_for(reconciler.active.wait(), 10)
        return reconciler

    async def start_runner(self) -> tuple[asyncio.Event, asyncio.Task]:
        runner = await open_runner(
            self.tether.nc, self.settings.model_copy(update={"work_ack_wait_ms": 1500}),
            self.registry, fetch_timeout_s=0.3, cancel_grace_s=2.0, shutdown_grace_s=0.2,
            parent_client=lambda ref: self.tether.parent(ref.agent, ref.name))
        handle = (asyncio.Event(), None)
        task = asyncio.create_task(runner.run(handle[0]))
        self.stops.append((handle[0], task))
        return handle[0], task

    async def stop_runner(self, handle) -> None:
        stop, task = handle
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        self.stops = [(s, t) for s, t in self.stops if t is not task]

    async def hand_over(self, handle, run_id: str, timeout: float = 30):
        """Stop the runner `handle` (it gives `run_id` back, as on SIGTERM) and start
        another; its handle once it has taken the run over (the run's second attempt)."""
        await self.stop_runner(handle)
        taking = await self.start_runner()

        async def second_attempt():
            return (await self.state(run_id)).attempt == 2

        await eventually(second_attempt, timeout=timeout)
        return taking

    async def state(self, run_id: str):
        return (await self.tether.read_run(self.parent.ref, run_id)).state

    async def until_paused(self, run_id: str, timeout: float = 30):
        """The run's state once it waits for an answer."""
        async def paused():
            state = await self.state(run_id)
            return state is not None and state.paused is not None and state

        return await eventually(paused, timeout=timeout)

    async def close(self) -> None:
        for stop, _ in self.stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in self.stops)), timeout=10)


@contextlib.asynccontextmanager
async def running_stack(settings, log, pool, agents: list, *, runner: bool = True,
                        reconciler: bool = False) -> AsyncIterator[Stack]:
    """A `Stack` of `agents` on its own client connection: the parent service, and a
    child-runner and the reconciler when asked; all stopped when the block ends."""
    async with connect(settings=settings) as tether:
        stack = Stack(settings, log, pool, tether, agents)
        await stack.start_parent()
        if runner:
            await stack.start_runner()
        if reconciler:
            await stack.start_reconciler()
        try:
            yield stack
        finally:
            await stack.close()
