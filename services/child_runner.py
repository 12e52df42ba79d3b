"""The child-runner service: runs the child agents named by TETHER_AGENTS / --agents."""

import asyncio

from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.bootstrap import Needs, Service, bootstrap
from tether.child.agent import ChildAgent
from tether.child.loading import load_agents
from tether.child.runner import ChildRunner, consumer_name
from tether.client.connection import Tether
from tether.config import Settings
from tether.log import get_logger
from tether.loop_watch import LoopWatch
from tether.metrics import RUNNER_SLOTS, WORK_PENDING
from tether.runtime import ReadinessCheck, nats_check


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
        runner = ChildRunner(nc, settings, registry,
                             shutdown_grace_s=settings.runner_shutdown_grace_ms / 1000,
                             parent_client=lambda ref: client.parent(ref.agent, ref.name))
        if not await service.starting("creating the work consumers", runner.start):
            return

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
