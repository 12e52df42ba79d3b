"""Faults injected under load, black-box: real nats-server(s), Postgres and services.

`make test` runs the scenarios not marked `long`; `make test-chaos` runs them all. Each
prints one line with its figures (`pytest -s` shows them)."""

import asyncio
import json
import signal
import time

import pytest
from chaos import Load, Report, chaos_system
from chaos_servers import namespaces_available
from eventually import eventually
from service_processes import http_status

from tether.adapters.nats_connection import connect_nats

long = pytest.mark.long
# `make test-chaos`: the load the scenarios were first tried with, 300 runs.
LONG_LOAD = Load(detached=240, awaited=60)


async def until_hooks(system, count: int) -> None:
    """Until the application has handled `count` finish hooks: the load is under way."""
    await eventually(lambda: len(system.hook_calls) >= count, timeout=60, interval=0.05)


async def scenario(name: str, fault, *, load: Load | None = None, runner_died: bool = False,
                   long_load: bool = False, **options) -> Report:
    load = load or (LONG_LOAD if long_load else Load())
    report = Report(name)
    async with chaos_system(**options) as system:
        async def inject() -> None:
            await until_hooks(system, 3)
            await fault(system)

        await system.run_load(load, inject, report, runner_died=runner_died)
    print(report.line())
    return report


async def long_scenario(name: str, fault, **options) -> Report:
    return await scenario(name, fault, long_load=True, **options)


async def restart_nats(system, sig: int) -> None:
    if sig == signal.SIGKILL:
        system.connections_cut_at.append(time.time())
    system.nats.stop(0, sig)
    # Readiness tells the truth while the broker is away (and `run_load` waits for
    # every service to be ready again at the end).
    await asyncio.gather(*(not_ready(service) for service in system.services))
    await asyncio.sleep(1.0)  # the rest of the outage
    system.nats.start(0)


async def not_ready(service, timeout: float = 10) -> None:
    async def unready() -> bool:
        return await http_status(service.health_port, "/readyz") == 503

    await eventually(unready, timeout=timeout, interval=0.05)


async def test_nats_stopped_gracefully_and_restarted():
    await scenario("nats-sigterm", lambda system: restart_nats(system, signal.SIGTERM))


@long
async def test_nats_killed_and_restarted():
    await long_scenario("nats-sigkill", lambda system: restart_nats(system, signal.SIGKILL))


async def restart_postgres(system, mode: str) -> None:
    await asyncio.to_thread(system.postgres.stop, mode)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(system.postgres.start)


async def test_postgres_restarted_fast():
    await scenario("postgres-fast", lambda system: restart_postgres(system, "fast"))


@long
async def test_postgres_restarted_immediate():
    await long_scenario("postgres-immediate", lambda system: restart_postgres(system, "immediate"))


def kill_and_restart(name: str):
    async def fault(system) -> None:
        await system.kill(system.of(name)[0])
        await system.start_service(name)
    return fault


@long
@pytest.mark.parametrize("name", ["parent", "child-runner", "projector", "reconciler"])
async def test_a_service_killed_and_restarted(name):
    await long_scenario(f"sigkill-{name}", kill_and_restart(name),
                   runner_died=name == "child-runner")


def rolling(name: str):
    """Start a new replica, stop an old one gracefully; twice (two replicas at a time)."""
    async def fault(system) -> None:
        await system.start_service(name)
        for _ in range(2):
            await system.start_service(name)
            await system.terminate(system.of(name)[0])
    return fault


async def test_a_rolling_deploy_of_the_parents():
    # A child's steps are silent longer than the re-attach timeout: a parent replica
    # starting must not make a healthy awaited run look lost.
    await scenario("rolling-parents", rolling("parent"), load=Load(pace_s=0.6),
                   env={"TETHER_REATTACH_NO_PROGRESS_TIMEOUT_MS": "400"})


@long
async def test_a_rolling_deploy_of_the_child_runners():
    await long_scenario("rolling-runners", rolling("child-runner"), runner_died=True,
                   env={"TETHER_RUNNER_SHUTDOWN_GRACE_MS": "300"})


def lose_node(which: str):
    async def fault(system) -> None:
        index = (system.nats.leader_of(system.settings.subjects.events_stream)
                 if which == "leader" else 0)
        if which != "leader" and index == system.nats.leader_of(
                system.settings.subjects.events_stream):
            index = 1
        system.connections_cut_at.append(time.time())
        system.nats.stop(index, signal.SIGKILL)
        await asyncio.sleep(8.0)
        system.nats.start(index)
    return fault


@long
@pytest.mark.parametrize("which", ["follower", "leader"])
async def test_a_three_node_cluster_losing_a_node(which):
    await long_scenario(f"cluster-lose-{which}", lose_node(which), nats_nodes=3)


def partition_leader():
    """Cut the namespaced node off after making it the events stream's leader."""
    async def fault(system) -> None:
        nats, events = system.nats, system.settings.subjects.events_stream
        await make_leader(system, events, nats.nodes[-1].name)
        nats.partition()
        await asyncio.sleep(8.0)  # the partition itself
        nats.heal()
    return fault


async def make_leader(system, stream: str, node: str) -> None:
    """Ask the stream's leader to step down in favour of `node`, until it leads."""
    nc = await connect_nats(system.nats.url, name="chaos-stepdown")
    try:
        async with asyncio.timeout(30):
            while system.nats.leader_of(stream) != len(system.nats.nodes) - 1:
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                                 json.dumps({"placement": {"preferred": node}}).encode(),
                                 timeout=5)
                await asyncio.sleep(0.5)
    finally:
        await nc.drain()


@long
async def test_a_partition_cuts_off_the_events_streams_leader():
    if (reason := namespaces_available()) is not None:
        pytest.skip(reason)
    await long_scenario("partition-leader", partition_leader(), nats_nodes=3, partitionable=True)
