"""Faults injected under load, black-box: real nats-server(s), Postgres and services.

`make test` runs the scenarios not marked `long`; `make test-chaos` runs them all. Each
prints one line with its figures (`pytest -s` shows them)."""

import asyncio
import json
import signal
import time
from collections import Counter
from datetime import datetime

import asyncpg
import pytest
from chaos import Load, Report, chaos_system
from chaos_servers import namespaces_available
from eventually import eventually
from service_processes import ServiceProcess, http_status
from skewed_clock import faketime_env

from tether.adapters.nats_connection import connect_nats

long = pytest.mark.long
# `make test-chaos`: the load the scenarios were first tried with, 300 runs.
LONG_LOAD = Load(detached=240, awaited=60)


async def until_hooks(system, count: int) -> None:
    """Until the application has handled `count` finish hooks: the load is under way."""
    await eventually(lambda: len(system.hook_calls) >= count, timeout=60, interval=0.05)


async def scenario(name: str, fault, *, load: Load | None = None, runner_died: bool = False,
                   long_load: bool = False, after_hooks: int = 3, **options) -> Report:
    """`fault(system)` once `after_hooks` runs finished (0: as soon as the load is in)."""
    load = load or (LONG_LOAD if long_load else Load())
    report = Report(name)
    async with chaos_system(**options) as system:
        async def inject() -> None:
            await until_hooks(system, after_hooks)
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


FOLLOWERS = "projector,reconciler"  # the two in one process: the reconciler fed by the projector


@long
async def test_the_projector_and_reconciler_process_killed_and_restarted():
    """The two in one process (two such processes, a standby of each), the one whose
    reconciler leads killed mid-load: the standby's reconciler and projector lead, the
    reconciler taking the projector's batches, and nothing is lost or done twice."""
    async def fault(system) -> None:
        await system.kill(system.of(FOLLOWERS, leading="reconciler")[0])
        await system.start_service(FOLLOWERS)

    await long_scenario("sigkill-projector-reconciler", fault,
                        replicas={"projector": 0, "reconciler": 0, FOLLOWERS: 2})


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


# --- pauses (SIGSTOP, then SIGCONT) and skewed clocks -----------------------------------

# The long pauses' scenarios take more than the suite's 120 s on two busy cores.
PAUSE_TIMEOUT_S = 300


def in_flight(runner: ServiceProcess) -> int:
    """Child turns a runner started and has not finished (from its log lines)."""
    events = [line.get("event") for line in runner.lines]
    return events.count("chaos.turn_started") - events.count("work_item.done")


def pause_a_runner(seconds: float, *, busy: int):
    """Stop the child-runner with the most children in hand (once it has `busy`) for
    longer than the work's ack wait: its items go to the other runner meanwhile."""
    async def fault(system) -> None:
        def busiest() -> ServiceProcess | None:
            runner = max(system.of("child-runner"), key=in_flight)
            return runner if in_flight(runner) >= busy else None

        runner = await eventually(busiest, timeout=60, interval=0.02)
        print(f"pausing child-runner pid {runner.pid} with {in_flight(runner)} children "
              "in hand")
        lines_before_pause = len(runner.lines)
        await system.pause_service(runner, seconds)
        # What the runner did with the children it held once it woke up (the checks
        # judge it; this says it).
        await eventually(lambda: in_flight(runner) <= 0, timeout=60, interval=0.1)
        after = runner.lines[lines_before_pause:]
        outcomes = Counter(f"{line.get('outcome')}: {line.get('detail', '')}" for line in after
                           if line.get("event") == "work_item.done")
        turns = sum(1 for line in after if line.get("event") == "chaos.turn_started")
        print(f"child-runner pid {runner.pid} after its pause: {turns} child turns started, "
              f"work items done {dict(outcomes)}")
    return fault


async def test_a_child_runner_paused_past_its_ack_wait():
    # Short: an ack wait of 2 s, a pause of 5 s; each child runs about 3 s. Both runners
    # have free slots, so each has a pull request outstanding: the paused one's items
    # are redelivered while it is stopped, to the other or to its own pending request.
    report = await scenario("pause-runner", pause_a_runner(5.0, busy=4),
                            load=Load(detached=24, awaited=6, pace_s=1.0), after_hooks=0,
                            runner_died=True, replicas={"child-runner": 2},
                            env={"TETHER_WORK_ACK_WAIT_MS": "2000",
                                 "TETHER_RUNNER_CONCURRENCY": "24"})
    assert report.attempts_over_one > 0, "the pause took no work item from the paused runner"


@long
@pytest.mark.timeout(PAUSE_TIMEOUT_S)
async def test_a_child_runner_paused_15s_past_a_10s_ack_wait():
    # Each child runs about 6 s: the paused runner's are cut mid-turn.
    report = await scenario("pause-runner-15s", pause_a_runner(15.0, busy=4),
                            load=Load(pace_s=2.0), after_hooks=0, runner_died=True,
                            replicas={"child-runner": 2},
                            env={"TETHER_WORK_ACK_WAIT_MS": "10000",
                                 "TETHER_RUNNER_CONCURRENCY": "40"})
    assert report.attempts_over_one > 0, "the pause took no work item from the paused runner"


LEASE_SESSION = """
SELECT a.pid, extract(epoch FROM clock_timestamp() - a.state_change)::float8 AS quiet_s
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted
  AND l.objid = (hashtext($1)::bigint & 4294967295)::oid
"""
LEASE_KEYS = {"reconciler": "tether-reconciler:{prefix}", "projector": "tether-projector:{prefix}"}


def pause_the_leader(role: str, seconds: float):
    """Stop the active `role` right after its lease's confirmation (its session's last
    query has just ended), and end its lease's session while it is stopped.

    A SIGSTOP alone deposes no one: the stopped process's kernel keeps its connection
    open, so its session and its lock live on. A frozen host or VM, what the pause
    stands for, loses its sessions when the server's keepalives give up; the scenario
    does that part by terminating the lease's session. The standby then takes the lease
    while the old leader is stopped, and the old one wakes up to a lease it lost.
    """
    async def fault(system) -> None:
        def leader() -> ServiceProcess | None:
            leading = system.of(role)[0]
            return leading if any(line.get("event") == "leadership.acquired"
                                  for line in leading.lines) else None

        old = await eventually(leader, timeout=30)
        standby = next(service for service in system.of(role) if service is not old)
        key = LEASE_KEYS[role].format(prefix=system.prefix)
        conn = await asyncpg.connect(system.postgres.url)
        try:
            async def just_confirmed():
                row = await conn.fetchrow(LEASE_SESSION, key)
                return row if row is not None and row["quiet_s"] < 0.03 else None

            session = await eventually(just_confirmed, timeout=30, interval=0.005)
            acquired_before = _count(standby, "leadership.acquired")

            async def depose(_: float) -> None:
                assert await conn.fetchval("SELECT pg_terminate_backend($1)", session["pid"])
                await eventually(lambda: _count(standby, "leadership.acquired") > acquired_before,
                                 timeout=seconds - 1, interval=0.05)

            lines_before_pause = len(old.lines)
            lost_before = _count(old, "leadership.lost")
            pause = await system.pause_service(old, seconds, meanwhile=depose)
        finally:
            await conn.close()
        # Bounded by the lease's check interval: the old leader notices its loss.
        await eventually(lambda: _count(old, "leadership.lost") > lost_before, timeout=30)
        # What it logged from its wake-up to that notice (the checks judge it; this says it).
        after = [line.get("event") for line in old.lines[lines_before_pause:]]
        lost = next(line for line in old.lines[lines_before_pause:]
                    if line.get("event") == "leadership.lost")
        print(f"{role} pid {old.pid} after its pause: logged {after[:after.index('leadership.lost')]} "
              f"then leadership.lost ({lost.get('error')}), "
              f"{datetime.fromisoformat(lost['timestamp']).timestamp() - pause.continued_at:.3f}s "
              "after its SIGCONT")
    return fault


def _count(service: ServiceProcess, event: str) -> int:
    return sum(1 for line in service.lines if line.get("event") == event)


@long
@pytest.mark.timeout(PAUSE_TIMEOUT_S)
@pytest.mark.parametrize("role", ["reconciler", "projector"])
async def test_the_leader_paused_15s_and_deposed(role):
    # Ticker runs that outlast the pause give the reconciler deadlines to keep.
    await scenario(f"pause-leader-{role}", pause_the_leader(role, 15.0),
                   load=Load(pace_s=1.0, ticking=10, tick_s=25.0))


@long
@pytest.mark.timeout(PAUSE_TIMEOUT_S)
async def test_nats_paused_8s():
    # A stopped server's ack-wait timers run out when it resumes: a child turn in hand
    # then may be redelivered, as after a runner's death.
    await scenario("pause-nats", lambda system: system.pause_nats(8.0), load=Load(pace_s=1.0),
                   runner_died=True)


@long
@pytest.mark.timeout(PAUSE_TIMEOUT_S)
async def test_postgres_paused_10s():
    async def fault(system) -> None:
        pause = await system.pause_postgres(10.0)
        assert pause.continued_at - pause.stopped_at >= 10.0

    await scenario("pause-postgres", fault, load=Load(pace_s=1.0))


def skewed_clock(name: str, offset_s: float):
    """The fault is in place from the start; checked here, so that a scenario cannot
    pass with clocks that were never skewed."""
    async def fault(system) -> None:
        for service in system.services:
            expected = offset_s if service.name == name else 0.0
            measured = service.clock_offset_s()
            assert abs(measured - expected) < 3.0, (
                f"{service.name} pid {service.pid}'s clock is {measured:+.1f}s off this "
                f"one's, not {expected:+.0f}s")
        print(f"{name}'s clock {offset_s:+.0f}s: measured "
              + ", ".join(f"{s.clock_offset_s():+.2f}s" for s in system.of(name)))
    return fault


@long
@pytest.mark.timeout(PAUSE_TIMEOUT_S)
@pytest.mark.parametrize(("name", "offset"), [("reconciler", "+30s"), ("child-runner", "-30s")])
async def test_a_skewed_clock(name, offset):
    await scenario(f"skew-{name}{offset}", skewed_clock(name, float(offset[:-1])),
                   load=Load(ticking=10, tick_s=7.0, tick_budget_ms=5000),
                   service_env={name: faketime_env(offset)})
