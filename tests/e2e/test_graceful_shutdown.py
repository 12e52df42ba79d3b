"""SIGTERM under load: each service drains and exits 0 within its grace period, and its
`/metrics` shows the work it was doing.

The child-runner hands its in-flight work back (NAK), so another runner resumes it at
once rather than after the ack wait; the others finish the batch in hand and lose
nothing a restarted replica would not pick up.
"""

import asyncio
import signal
import time
from contextlib import aclosing

from eventually import eventually

from tether.adapters.event_log import EventLog
from tether.adapters.postgres.migrator import migrate
from tether.contract.messages import WorkItem, read_work_item, work_item_json
from tether.domain.commands import RunCommand
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.domain.ids import work_message_id
from tether.testing import RunEvents, append_finished_runs

PARENT = ParentRef(agent="Assistant", name="drain")
# Well inside the 30 s Kubernetes grace period, with room for a slow CI machine.
EXIT_WITHIN_S = 10.0


async def scrape(port: int) -> dict[str, float]:
    """`/metrics` as {sample with labels: value} (labels in name order, as
    prometheus_client writes them)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    response = (await reader.read()).decode()
    writer.close()
    head, _, body = response.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200") and "text/plain; version=0.0.4" in head, head
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def ready(service) -> None:
    """Until /readyz answers 200: the service has registered its checks and collectors."""
    async with asyncio.timeout(20):
        while True:
            reader, writer = await asyncio.open_connection("127.0.0.1", service.health_port)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            status = (await reader.readline()).split()[1]
            writer.close()
            if status == b"200":
                return
            await asyncio.sleep(0.02)


async def stop_within_grace(service) -> float:
    started = time.monotonic()
    service.signal(signal.SIGTERM)
    assert await service.wait(timeout=EXIT_WITHIN_S) == 0
    assert any(line.get("event") == "service.stopped" for line in service.lines)
    return time.monotonic() - started


async def dispatch_sleeper(log: EventLog, run_id: str) -> RunEvents:
    """A requested Sleeper run of a minute and its work item, as a parent would send them."""
    run = RunEvents(run_id, PARENT, start_ms=int(time.time() * 1000))
    await log.append_batch([run.requested("Sleeper", input={"seconds": 60}), run.started()],
                           expected_last_seq=0)
    item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type="Sleeper")
    await log.jetstream.publish(log.subjects.work("Sleeper"), work_item_json(item),
                                headers={"Nats-Msg-Id": work_message_id(run.run_id, 1)},
                                stream=log.subjects.work_stream)
    return run


async def watch_runs(log: EventLog, until, timeout: float = 20) -> dict:
    """Fold every run of PARENT from the log until `until(states)` holds."""
    states: dict = {}
    follow = log.follow(log.subjects.parent_events(PARENT))
    async with asyncio.timeout(timeout), aclosing(follow) as events:
        async for stored in events:
            event = stored.event
            states[event.run_id] = evolve(states.get(event.run_id), event).state
            if until(states):
                return states
    raise AssertionError("unreachable")


async def test_a_child_runner_hands_its_running_work_back_and_another_resumes_it(log, services):
    agents = {"TETHER_AGENTS": "examples.agents:Sleeper", "TETHER_RUNNER_SHUTDOWN_GRACE_MS": "300"}
    first = await services("child-runner", **agents)
    await ready(first)
    for i in range(3):
        await dispatch_sleeper(log, f"sleep-{i}")
    await watch_runs(log, lambda s: sum(r.status == "running" for r in s.values()) == 3)

    metrics = await scrape(first.health_port)
    assert metrics["tether_runner_slots_in_use"] == 3
    assert metrics["tether_runner_slots"] == 16
    assert metrics['tether_work_pending{agent_type="Sleeper"}'] == 3

    await stop_within_grace(first)
    released = [line for line in first.lines if line.get("outcome") == "released"]
    assert len(released) == 3
    # The default ack wait is 30 s: resuming within the timeout below proves the NAK.
    await services("child-runner", **agents)
    resumed = await watch_runs(log, lambda s: all(r.attempt == 2 for r in s.values()), timeout=10)
    assert sorted(resumed) == ["sleep-0", "sleep-1", "sleep-2"]


async def test_a_parent_finishes_the_batch_in_hand_and_loses_no_command(log, pool, services):
    agents = {"TETHER_AGENTS": "examples.agents:Summarizer"}
    parent = await services("parent", **agents)
    await ready(parent)
    run_ids = [f"cmd-{i}" for i in range(300)]
    # Every run's work item, as each parent publishes it (a core subscription sees each;
    # the work queue admits no second consumer).
    dispatched: set[str] = set()
    all_dispatched = asyncio.Event()

    async def on_item(msg) -> None:
        dispatched.add(read_work_item(msg.data).run_id)
        if dispatched >= set(run_ids):
            all_dispatched.set()

    items = await log.nats.subscribe(log.subjects.work("Summarizer"), cb=on_item)
    await log.nats.flush()
    acks = [await log.jetstream.publish_async(
        log.subjects.command("run"), RunCommand(
            run_id=run_id, parent=PARENT, agent_type="Summarizer",
            input={"text": run_id}).model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"run:{run_id}"}) for run_id in run_ids]
    await asyncio.gather(*acks)
    handled_metric = 'tether_handler_seconds_count{handler="command.run",service="parent"}'
    async def handled() -> object:
        return (await scrape(parent.health_port)).get(handled_metric)

    await eventually(handled, timeout=20, interval=0.01)
    await stop_within_grace(parent)

    restarted = await services("parent", **agents)
    await asyncio.wait_for(all_dispatched.wait(), timeout=20)
    await items.unsubscribe()
    assert dispatched == set(run_ids)
    # One item kept per run: a command applied again published its item with the same id.
    work = await log.jetstream.stream_info(log.subjects.work_stream)
    assert work.state.messages == len(run_ids)
    for run_id in run_ids:
        history = await log.read_run(PARENT, run_id)
        assert [e.type for e in history.events] == ["run.requested"], run_id
    await stop_within_grace(restarted)


async def test_a_projector_commits_the_batch_in_hand_and_reports_its_lag(log, pool, services,
                                                                          settings):
    """Stopped while far behind the log, with its batch held up by Postgres (a lock the
    test holds on `runs`): it commits that batch, and no more, and exits."""
    total = await append_finished_runs(log, 150, parent=PARENT)  # 9 events a run
    schema = settings.projection_schema
    async with pool.acquire() as conn:
        await migrate(conn, schema)
    async with pool.acquire() as locker:
        held = locker.transaction()
        await held.start()
        await locker.execute(f'LOCK TABLE "{schema}".runs IN EXCLUSIVE MODE')
        projector = await services("projector", TETHER_PROJECTOR_BATCH_SIZE="25")
        await ready(projector)

        async def batch_waits() -> bool:
            return await pool.fetchval(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass",
                f'"{schema}".runs') > 0

        await eventually(batch_waits, timeout=20, interval=0.02)
        metrics = await scrape(projector.health_port)
        assert metrics["tether_events_appended_total"] == total
        assert metrics["tether_projector_active"] == 1
        assert metrics["tether_projector_position"] == 0
        assert metrics["tether_projector_lag_events"] == total

        projector.signal(signal.SIGTERM)
        await projector.logged("service.stopping")
        await held.rollback()
    assert await projector.wait(timeout=EXIT_WITHIN_S) == 0
    checkpoint = await _checkpoint(pool, schema)
    assert 0 < checkpoint <= 25, "the batch in hand was committed, and no more"
    projected = await pool.fetchval(
        f'SELECT coalesce(sum(events_applied), 0) FROM "{schema}".runs')
    assert projected == checkpoint, "rows and checkpoint were committed together"

    survivor = await services("projector")
    await ready(survivor)
    await survivor.logged("leadership.acquired")  # it leads once its lease's grace is over
    async def caught_up() -> bool:
        return await _checkpoint(pool, schema) >= total

    await eventually(caught_up, timeout=20, interval=0.02)
    metrics = await scrape(survivor.health_port)
    assert metrics["tether_projector_lag_events"] == 0
    assert metrics["tether_projector_lag_seconds"] == 0
    assert metrics['tether_runs{agent_type="Researcher",status="completed"}'] == 100
    assert metrics['tether_runs{agent_type="Researcher",status="error"}'] == 50
    await stop_within_grace(survivor)


async def test_a_reconciler_stops_between_decisions(log, pool, services):
    reconciler = await services("reconciler")
    await ready(reconciler)
    now = int(time.time() * 1000)
    for i in range(20):
        run = RunEvents(f"budget-{i}", PARENT, start_ms=now)
        requested = run.requested("Sleeper", input={"seconds": 60}, detached={"notify": True},
                                  max_budget_ms=200 + i * 20)
        await log.append_batch([requested, run.started(), run.running()], expected_last_seq=0)
    await watch_runs(log, lambda s: sum(r.status == "interrupted" for r in s.values()) >= 3)
    metrics = await scrape(reconciler.health_port)
    assert metrics["tether_reconciler_active"] == 1
    assert metrics['tether_deadlines_fired_total{kind="budget"}'] >= 3
    assert metrics['tether_deadlines_due_total{kind="budget"}'] >= 3
    await stop_within_grace(reconciler)


async def _checkpoint(pool, schema: str) -> int:
    try:
        return await pool.fetchval(
            f'SELECT coalesce(max(last_seq), 0) FROM "{schema}".checkpoints')
    except Exception as error:  # the projector has not created the schema yet
        if "does not exist" not in str(error):
            raise
        return 0


async def test_a_second_ctrl_c_stops_a_draining_child_runner_at_once(log, services):
    """The first SIGINT starts the graceful stop, which lets running children finish for
    the shutdown grace (here a minute); the second ends the process now, saying so, and
    the run goes to the next runner as after a crash."""
    agents = {"TETHER_AGENTS": "examples.agents:Sleeper",
              "TETHER_RUNNER_SHUTDOWN_GRACE_MS": "60000", "TETHER_WORK_ACK_WAIT_MS": "1500"}
    first = await services("child-runner", **agents)
    await ready(first)
    run = await dispatch_sleeper(log, "interrupted-twice")
    await watch_runs(log, lambda s: s[run.run_id].status == "running")

    first.signal(signal.SIGINT)
    await first.logged("child_runner.draining")
    started = time.monotonic()
    first.signal(signal.SIGINT)
    assert await first.wait(timeout=EXIT_WITHIN_S) == 128 + signal.SIGINT
    assert time.monotonic() - started < 3
    [now] = await first.logged("service.stopped_at_once")
    assert now["signal"] == "SIGINT" and "resumed by another runner" in now["detail"]

    await services("child-runner", **agents)
    resumed = await watch_runs(log, lambda s: s[run.run_id].attempt == 2, timeout=15)
    assert resumed[run.run_id].status == "running"
