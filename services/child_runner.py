"""The child-runner service: runs the child agents named by TETHER_AGENTS / --agents.

`open_runner` is the runner's one wiring: every part it runs with is made here, once."""

import asyncio
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from tether.adapters.control import start_control
from tether.adapters.event_log import EventLog
from tether.adapters.pull import durable_pull
from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.agent import ChildAgent
from tether.child.loading import load_agents
from tether.child.runner import (
    ChildRunner,
    consumer_config,
    consumer_name,
    new_runner_id,
    runner_control,
)
from tether.child.work import RunnerEnvironment
from tether.client.connection import Tether
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import parent_formatters
from tether.domain.events import ParentRef
from tether.log import get_logger
from tether.loop_watch import LoopWatch
from tether.metrics import RUNNER_SLOTS, WORK_PENDING
from tether.runtime import ReadinessCheck, nats_check


async def open_runner(nc: NATS, settings: Settings, registry: AgentRegistry[ChildAgent], *,
                      runner_id: str | None = None, cancel_grace_s: float | None = None,
                      parent_client: Callable[[ParentRef], Any] | None = None,
                      **options: Any) -> ChildRunner:
    """The child-runner, wired: its event log; the deliverer of the hooks and notices its
    executions owe (worded by the parent classes' formatters; it keeps no delivery
    records, the parent and the reconciler do); a work consumer per agent type, created or
    updated; and the broker of its control handlers, started. `options` are the runner's
    own (`ChildRunner`). Safe to retry: every step creates or finds what it needs."""
    runner_id = runner_id or new_runner_id()
    log = EventLog(nc, settings.subjects)
    deliverer = await Deliverer.open(
        settings, log, parent_formatters(settings.formatters, registry),
        get_logger(service="child-runner", runner_id=runner_id), records=False)
    pulls = {agent_type: await durable_pull(nc.jetstream(), nc, settings.subjects.work_stream,
                                            consumer_config(settings, agent_type))
             for agent_type in registry.agent_types}
    env = RunnerEnvironment(
        log=log, settings=settings, runner_id=runner_id,
        cancel_grace_s=(settings.cancel_grace_ms / 1000 if cancel_grace_s is None
                        else cancel_grace_s),
        parent_client=parent_client, deliverer=deliverer)
    runner = ChildRunner(nc, env, registry, control=runner_control(settings), pulls=pulls,
                         **options)
    runner.subscribe_control()
    await start_control(runner.control)
    return runner


def _registry(settings: Settings) -> AgentRegistry[ChildAgent]:
    """The child agents to run; none, or one that cannot be loaded, stops the service."""
    try:
        registry = load_agents(settings.agents)
        if not registry:
            raise AgentConfigurationError(
                "no child agents to run: set TETHER_AGENTS or pass --agents module:Class[,...]")
        for agent in registry.classes:
            agent.check_configuration()
    except AgentConfigurationError as error:
        # Nothing useful can run; say why in one line instead of a traceback.
        get_logger(service="child-runner").error("child_runner.misconfigured", error=str(error))
        raise SystemExit(2) from None
    return registry


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, ReadinessCheck]) -> None:
    registry = _registry(settings)

    async def run(service: Service) -> None:
        nc, js = service.nc, service.js
        # A child may itself be a parent: its nested runs go through the same connection,
        # owned by (its agent type, its run id), so they stay off the top parent's timeline.
        client = Tether(nc, settings)
        opened: list[ChildRunner] = []

        async def start() -> None:
            opened.append(await open_runner(
                nc, settings, registry,
                shutdown_grace_s=settings.runner_shutdown_grace_ms / 1000,
                parent_client=lambda ref: client.parent(ref.agent, ref.name)))

        if not await service.starting("creating the work consumers", start):
            return
        runner = opened[-1]

        async def streams_present() -> tuple[bool, str]:
            for stream in (settings.subjects.work_stream, settings.subjects.events_stream,
                           settings.subjects.progress_stream):
                await js.stream_info(stream)
            return True, "work, events and progress streams present"

        async def consuming() -> tuple[bool, str]:
            agents = ", ".join(registry.agent_types)
            if runner.consuming:
                return True, f"consuming work for {agents}"
            return False, "not consuming (starting or stopping)"

        service.ready(control=nats_check(runner.control.connection), streams=streams_present,
                      consuming=consuming)
        watch = LoopWatch(asyncio.get_running_loop(), get_logger(service="child-runner"),
                          warn_after_s=settings.loop_blocked_warn_ms / 1000)
        watch.start()
        service.removals.append(watch.stop)
        RUNNER_SLOTS.set(settings.runner_concurrency)

        async def collect_work_queue() -> None:
            # Waiting plus held items: what an autoscaler on work would look at.
            for agent_type in registry.agent_types:
                info = await js.consumer_info(settings.subjects.work_stream,
                                              consumer_name(agent_type))
                WORK_PENDING.set(info.num_pending + info.num_ack_pending, agent_type=agent_type)

        service.collect(collect_work_queue)
        await runner.run(stop)

    await bootstrap(settings, stop, checks, Needs("tether-child-runner"), run)
