"""Finish-hook handlers against real JetStream: registration, ledger, retries.

No parent service: run histories are appended with `EventLog.append`, and HookMessages
are published to the hook subjects the way the parent publishes them.
"""

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator

import pytest
from eventually import eventually

from tether.adapters.deliveries import DeliveryRecords
from tether.adapters.event_log import EventLog
from tether.client import ServiceUnavailable, Tether, connect, hook_calls
from tether.client.hooks import consumer_config, consumer_name
from tether.contract.messages import FIRST_PUBLICATION_HEADER, HookMessage, LifecycleResult, RunInfo
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import load_formatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.domain.commands import DeliveredCommand
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef, RunFinishDelivered
from tether.domain.ids import GLOBAL_FINISH_HOOK, finish_message_id
from tether.domain.run_state import RunState
from tether.log import get_logger
from tether.testing import RunEvents

PARENT = ParentRef(agent="Importer", name="acme")
METHOD = "on_import_done"
LEASE_MS = 300  # the configured lease: short, for the retry test
STEADY_LEASE_MS = 30_000  # elsewhere a slow machine must not cause a redelivery


@pytest.fixture
async def tether(log: EventLog, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings.model_copy(update={"hook_lease_ms": LEASE_MS})) as client:
        yield client


async def finished_run(log: EventLog, run_id: str, method: str = METHOD, *extra) -> RunState:
    run = RunEvents(run_id, PARENT)
    events = [run.requested("ImportAgent", detached=DetachedOptions(on_finish=method)),
              run.started(), run.running(), run.completed(f"imported {run_id}"), *extra]
    for event in events:
        await log.append(event, expected_last_seq=None)
    return (await log.read_run(PARENT, run_id)).state


async def publish_hook(log: EventLog, state: RunState, method: str = METHOD,
                       msg_id: str | None = None, first: bool = False) -> None:
    """As the parent publishes it; `first`: marked as the outcome's first publication."""
    message = HookMessage(method=method, run=RunInfo.of(state), result=LifecycleResult.of(state))
    headers = {"Nats-Msg-Id": msg_id or finish_message_id(state, state.status, method)}
    if first:
        headers[FIRST_PUBLICATION_HEADER] = "1"
    await log.jetstream.publish(
        log.subjects.hook(PARENT.agent, method), message.model_dump_json().encode(),
        headers=headers, stream=log.subjects.hooks_stream)


def count_reads(tether: Tether, monkeypatch) -> list[str]:
    """The run ids the handler reads from the log (its ledger check)."""
    reads: list[str] = []
    read_run = tether.log.read_run

    async def counting(parent, run_id, **options):
        reads.append(run_id)
        return await read_run(parent, run_id, **options)

    monkeypatch.setattr(tether.log, "read_run", counting)
    return reads


def record_reads(monkeypatch, answer_after: asyncio.Event | None = None) -> list[str]:
    """The message ids whose delivery record the handlers read; with `answer_after`, each
    read is answered only once that event is set (a slow broker)."""
    reads: list[str] = []
    recorded = DeliveryRecords.recorded

    async def reading(records, parent, method, message_id):
        reads.append(message_id)
        if answer_after is not None:
            await answer_after.wait()
        return await recorded(records, parent, method, message_id)

    monkeypatch.setattr(DeliveryRecords, "recorded", reading)
    return reads


async def ledger_entry(log: EventLog, run_id: str, timeout: float = 10) -> RunFinishDelivered:
    """Wait for the run's `run.finish_delivered` event as it is appended."""
    async with asyncio.timeout(timeout):
        async for stored in log.follow(log.subjects.run_events(PARENT, run_id)):
            if isinstance(stored.event, RunFinishDelivered):
                return stored.event
    raise AssertionError("unreachable")


async def settled(tether: Tether, method: str = METHOD, timeout: float = 10) -> None:
    """Wait until the method's consumer has no message waiting or in delivery."""
    async def drained() -> bool:
        info = await tether.js.consumer_info(tether.subjects.hooks_stream,
                                             consumer_name(PARENT.agent, method))
        return info.num_pending == 0 and info.num_ack_pending == 0

    await eventually(drained, timeout=timeout, interval=0.02)


class Recorder:
    def __init__(self, failures: int = 0) -> None:
        self.calls: list[tuple[RunInfo, LifecycleResult, float]] = []
        self.failures = failures
        self.called = asyncio.Event()

    async def __call__(self, run: RunInfo, result: LifecycleResult) -> None:
        self.calls.append((run, result, time.monotonic()))
        if len(self.calls) <= self.failures:
            raise RuntimeError(f"transient failure {len(self.calls)}")
        self.called.set()


async def test_a_hook_is_registered_called_once_and_recorded_in_the_ledger(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.on_finish(METHOD)(recorder)
    async with hooks.running():
        bucket = await tether.js.key_value(tether.subjects.registry_bucket)
        entry = await bucket.get(f"hook.{PARENT.agent}.{METHOD}")
        assert json.loads(entry.value)["registered_at"] > 0

        state = await finished_run(log, "import-1")
        await publish_hook(log, state)
        delivered = await ledger_entry(log, "import-1")
        await settled(tether)

    assert len(recorder.calls) == 1
    run, result, _ = recorder.calls[0]
    assert (run.run_id, run.detached.on_finish) == ("import-1", METHOD)
    assert (result.status, result.summary) == ("completed", "imported import-1")
    assert (delivered.data.status, delivered.data.method) == ("completed", METHOD)
    assert delivered.data.message_id == finish_message_id(state, "completed", METHOD)
    assert (await log.read_run(PARENT, "import-1")).state.finish_delivered("completed", METHOD)
    assert hooks.stats.called == 1


async def test_a_cleared_lifes_hook_is_called_but_not_recorded_on_the_run_ids_next(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.on_finish(METHOD)(recorder)
    first_life = await finished_run(log, "import-lives")
    again = RunEvents("import-lives", PARENT, id_prefix="again")
    for event in (again.cleared(), again.requested("ImportAgent", detached=DetachedOptions(
            on_finish=METHOD)), again.running(), again.completed("imported again")):
        await log.append(event, expected_last_seq=None)
    async with hooks.running():
        await publish_hook(log, first_life, first=True)  # handled after the clear
        await asyncio.wait_for(recorder.called.wait(), timeout=10)
        await settled(tether)
    [(run, result, _)] = recorder.calls
    assert (run.run_id, result.summary) == ("import-lives", "imported import-lives"), (
        "the first life's outcome")
    state = (await log.read_run(PARENT, "import-lives")).state
    assert state.summary == "imported again" and not state.finish_delivered("completed", METHOD)


async def test_a_raising_function_is_retried_after_the_lease_and_never_dropped(log, tether):
    recorder = Recorder(failures=2)
    hooks = tether.hooks(PARENT.agent, ledger="direct")  # the lease from the settings
    hooks.register(METHOD, recorder)
    async with hooks.running():
        state = await finished_run(log, "import-2")
        await publish_hook(log, state)
        await ledger_entry(log, "import-2")
        await settled(tether)

    times = [at for _, _, at in recorder.calls]
    assert len(times) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert all(gap >= LEASE_MS / 1000 * 0.9 for gap in gaps), gaps
    assert hooks.stats.failed == 2 and hooks.stats.called == 1


async def test_a_hook_already_in_the_ledger_is_acknowledged_without_a_call(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.register(METHOD, recorder)
    run = RunEvents("import-3", PARENT, id_prefix="ledger", start_ms=90_000)
    recorded = run.make(RunFinishDelivered, status="completed", method=METHOD,
                        message_id="finish:import-3:completed")
    state = await finished_run(log, "import-3", METHOD, recorded)
    async with hooks.running():
        await publish_hook(log, state)
        await settled(tether)
    assert recorder.calls == []
    assert hooks.stats.skipped == 1


async def test_a_redelivered_hook_does_not_call_the_function_again(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.register(METHOD, recorder)
    async with hooks.running():
        state = await finished_run(log, "import-4")
        await publish_hook(log, state)
        await ledger_entry(log, "import-4")
        # The reconciler's retry (or a publish after a lost ack) is a new message.
        await publish_hook(log, state, msg_id="finish:import-4:completed:retry")
        await settled(tether)
    assert len(recorder.calls) == 1
    assert hooks.stats.skipped == 1


async def test_a_first_publication_is_handled_without_reading_the_ledger(
        log, tether, monkeypatch):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS)
    hooks.register(METHOD, recorder)
    reads = count_reads(tether, monkeypatch)
    async with hooks.running():
        first, other = await finished_run(log, "import-5"), await finished_run(log, "import-6")
        await publish_hook(log, first, first=True)
        await publish_hook(log, other)  # not marked (an older parent, or a retry)
        await settled(tether)
    assert sorted(run.run_id for run, _, _ in recorder.calls) == ["import-5", "import-6"]
    assert reads == ["import-6"]


async def test_a_first_publication_redelivered_reads_the_ledger(log, tether, monkeypatch):
    recorder = Recorder(failures=1)
    hooks = tether.hooks(PARENT.agent, ledger="direct")  # the short lease: redelivered soon
    hooks.register(METHOD, recorder)
    async with hooks.running():
        state = await finished_run(log, "import-7")
        reads = count_reads(tether, monkeypatch)
        await publish_hook(log, state, first=True)
        await ledger_entry(log, "import-7")
        await settled(tether)
    assert len(recorder.calls) == 2 and hooks.stats.called == 1
    assert "import-7" in reads, "the redelivery looked at the ledger before calling again"


async def test_two_replicas_share_the_consumer_and_each_hook_runs_once(log, tether):
    calls: list[str] = []

    async def on_done(run: RunInfo, result: LifecycleResult) -> None:
        calls.append(run.run_id)

    states = [await finished_run(log, f"import-r{i}") for i in range(6)]
    async with connect(settings=tether.settings) as other:
        first = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
        second = other.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
        first.register(METHOD, on_done)
        second.register(METHOD, on_done)
        async with first.running(), second.running():
            for state in states:
                await publish_hook(log, state)
            for state in states:
                await ledger_entry(log, state.run_id)
            await settled(tether)
    assert sorted(calls) == sorted(state.run_id for state in states)


async def test_a_call_longer_than_the_lease_keeps_its_hook_from_the_other_replica(
        log, tether):
    """A function that runs for several leases, beside another replica: its handler
    renews the hook while it runs, so the server does not hand it to the other replica,
    which would call it a second time."""
    lease_ms, release = 600, asyncio.Event()
    calls: list[str] = []

    async def slow(run: RunInfo, result: LifecycleResult) -> None:
        calls.append(run.run_id)
        await release.wait()

    state = await finished_run(log, "import-slow")
    async with connect(settings=tether.settings) as other:
        replicas = [client.hooks(PARENT.agent, lease_ms=lease_ms, ledger="direct")
                    for client in (tether, other)]
        for replica in replicas:
            replica.register(METHOD, slow)
        async with replicas[0].running(), replicas[1].running():
            await publish_hook(log, state, first=True)
            await eventually(lambda: calls, timeout=10, interval=0.01)
            # Renewed for more than two leases: the other replica would have had it twice.
            await eventually(lambda: sum(r.stats.renewed for r in replicas) >= 7, timeout=20,
                             interval=0.05)
            release.set()
            await ledger_entry(log, "import-slow")
            await settled(tether)
    assert calls == ["import-slow"]
    assert sum(replica.stats.called for replica in replicas) == 1
    info = await tether.js.consumer_info(tether.subjects.hooks_stream,
                                         consumer_name(PARENT.agent, METHOD))
    assert info.delivered.consumer_seq == 1, info  # delivered once: never handed out again


async def forget_every_delivery(tether: Tether, method: str = METHOD) -> None:
    """What a broker that restarts before writing its consumers' state does: the next
    handler to bind gets every message again, each as a first delivery."""
    await tether.js.delete_consumer(tether.subjects.hooks_stream,
                                    consumer_name(PARENT.agent, method))


async def test_a_delivery_the_broker_forgot_is_not_made_again_by_another_replica(log, tether):
    """The ledger waits for the parent (not running here): only the first replica's
    record tells the second that the first publication, handed out again as new, was
    delivered."""
    first_calls, second_calls = Recorder(), Recorder()
    state = await finished_run(log, "import-forgotten")
    first = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS)
    first.on_finish(METHOD)(first_calls)
    async with first.running():
        await publish_hook(log, state, first=True)
        await asyncio.wait_for(first_calls.called.wait(), timeout=10)
        await settled(tether)
    await forget_every_delivery(tether)
    async with connect(settings=tether.settings) as other:
        second = other.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS)
        second.on_finish(METHOD)(second_calls)
        async with second.running():
            await eventually(lambda: second.stats.skipped == 1, timeout=10, interval=0.01)
            await settled(other)
    assert len(first_calls.calls) == 1 and second_calls.calls == []


async def test_a_delivery_the_broker_forgot_is_not_made_again_by_the_same_handler(
        log, tether, monkeypatch):
    """Its memory of the calls it made answers without a read of the records."""
    recorder = Recorder()
    state = await finished_run(log, "import-forgotten-here")
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS)
    hooks.on_finish(METHOD)(recorder)
    async with hooks.running():
        await publish_hook(log, state, first=True)
        await asyncio.wait_for(recorder.called.wait(), timeout=10)
        await settled(tether)
        reads = record_reads(monkeypatch)
        await forget_every_delivery(tether)
        # The handler's consumer is gone: bind it again, as after a broker restart.
        await tether.js.add_consumer(
            tether.subjects.hooks_stream,
            consumer_config(tether.subjects, PARENT.agent, METHOD,
                            lease_s=STEADY_LEASE_MS / 1000, max_ack_pending=32))
        await eventually(lambda: hooks.stats.skipped == 1, timeout=10, interval=0.01)
        await settled(tether)
    assert len(recorder.calls) == 1 and reads == []


async def test_the_global_hook_gets_every_detached_run(log, tether):
    seen: list[tuple[str, str]] = []
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")

    @hooks.on_any_finish
    def on_agent_tool_finish(run: RunInfo, result: LifecycleResult) -> None:
        seen.append((run.run_id, result.status))  # a plain function works too

    async with hooks.running():
        bucket = await tether.js.key_value(tether.subjects.registry_bucket)
        await bucket.get(f"hook.{PARENT.agent}.{GLOBAL_FINISH_HOOK}")
        state = await finished_run(log, "import-5", "elsewhere")
        await publish_hook(log, state, GLOBAL_FINISH_HOOK)
        delivered = await ledger_entry(log, "import-5")
        await settled(tether, GLOBAL_FINISH_HOOK)
    assert seen == [("import-5", "completed")]
    assert delivered.data.method == GLOBAL_FINISH_HOOK
    assert delivered.data.message_id == f"finish-global:import-5:completed:{state.incarnation}"


async def test_a_malformed_hook_message_is_terminated_not_retried(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.register(METHOD, recorder)
    async with hooks.running():
        await log.jetstream.publish(log.subjects.hook(PARENT.agent, METHOD), b"{not json",
                                    stream=log.subjects.hooks_stream)
        await settled(tether)
    assert recorder.calls == [] and hooks.stats.malformed == 1


async def test_registration_refuses_bad_names_and_serving_nothing(tether):
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    with pytest.raises(ValueError, match="cannot contain ':'"):
        hooks.register("on:done", Recorder())
    with pytest.raises(ValueError, match="invalid hook method"):
        hooks.register("on done", Recorder())
    with pytest.raises(ValueError, match="no hooks registered"):
        await hooks.serve()
    hooks.register(METHOD, Recorder())
    with pytest.raises(ValueError, match="already registered"):
        hooks.register(METHOD, Recorder())


async def test_serving_hooks_without_the_services_registry_says_what_is_missing(tether, log):
    # The parent service creates the registry; an application only opens it.
    await log.jetstream.delete_key_value(log.subjects.registry_bucket)
    hooks = tether.hooks("Importer")
    hooks.register(METHOD, lambda run, result: None)
    with pytest.raises(ServiceUnavailable, match=f"key-value bucket {log.subjects.registry_bucket}"
                                                 " does not exist: start the Tether services"):
        async with hooks.running():
            pass


async def test_a_repeat_is_recognised_while_the_parent_is_down(log, tether, settings):
    """The ledger waits for the parent (not running here); the handler's own record
    stops a retry from calling the function again, and the reconciler's deliverer
    records the ledger entry instead of publishing the hook once more."""
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS)  # ledger: the parent's
    hooks.on_finish(METHOD)(recorder)
    async with hooks.running():
        state = await finished_run(log, "import-down")
        await publish_hook(log, state)
        await asyncio.wait_for(recorder.called.wait(), timeout=10)
        await settled(tether)
        # The reconciler's retry after the lease, while the ledger still says nothing.
        assert not (await log.read_run(PARENT, "import-down")).state.finish_delivered(
            "completed", METHOD)
        await publish_hook(log, state, msg_id=finish_message_id(state, "completed", METHOD)
                           + ":retry1")
        await settled(tether)
        assert len(recorder.calls) == 1 and hooks.stats.skipped == 1

        records = await DeliveryRecords.open(log.jetstream, log.subjects.deliveries_bucket)
        registry = await log.jetstream.key_value(log.subjects.registry_bucket)
        deliverer = Deliverer(log, RegisteredHooks(registry), load_formatters(None),
                              get_logger(test="hooks"), records=records)
        published = await deliverer.deliver_finish(state, LifecycleResult.of(state), retry=2)
        assert published == 0
        after = (await log.read_run(PARENT, "import-down")).state
        assert after.finish_delivered("completed", METHOD)
        await settled(tether)
    assert len(recorder.calls) == 1


async def test_reports_of_hooks_finished_together_share_one_delivered_command(
        log, tether, monkeypatch):
    """With the parent's ledger (no parent service here, so the commands stay in the
    stream): the reports of hooks whose functions return together go out in one command,
    each once, and a report alone goes out in the plain form with its own id."""
    monkeypatch.setattr(hook_calls, "REPORT_LINGER_S", 1.0)  # one batch, however slow
    other = ParentRef(agent=PARENT.agent, name="globex")
    together = 5
    release = asyncio.Event()
    called: list[str] = []

    async def held(run: RunInfo, result: LifecycleResult) -> None:
        called.append(run.run_id)
        if len(called) == together:
            release.set()
        await release.wait()

    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, concurrency=8)
    hooks.on_finish(METHOD)(held)
    async with hooks.running():
        states = [await finished_run(log, f"batch-{i}") for i in range(together - 1)]
        run = RunEvents("batch-other", other)
        for event in (run.requested("ImportAgent", detached=DetachedOptions(on_finish=METHOD)),
                      run.started(), run.running(), run.completed("imported")):
            await log.append(event, expected_last_seq=None)
        states.append((await log.read_run(other, "batch-other")).state)
        for state in states:
            await publish_hook(log, state)
        await settled(tether)
        alone = await finished_run(log, "batch-alone")
        await publish_hook(log, alone)
        await settled(tether)

    stored, _ = await log.read_stored(log.subjects.commands_stream,
                                      f"{log.subjects.prefix}.cmd.delivered.>")
    batch, single = (DeliveredCommand.model_validate_json(msg.data) for msg in stored)
    assert [msg.headers["Nats-Subject"] for msg in stored] == [
        log.subjects.command_for("delivered", batch.parent),
        log.subjects.command_for("delivered", PARENT)]
    expected = {(s.run_id, s.parent.name, finish_message_id(s, "completed", METHOD))
                for s in states}
    assert {(r.run_id, r.parent.name, r.message_id) for r in batch.reports()} == expected
    assert len(batch.more) == together - 1
    assert stored[0].headers["Nats-Msg-Id"].startswith(
        f"delivered:{batch.parent.agent}.{batch.parent.name}:batch:")
    alone_id = finish_message_id(alone, "completed", METHOD)
    assert (single.run_id, single.message_id, single.more) == ("batch-alone", alone_id, [])
    assert b'"more"' not in stored[1].data
    assert stored[1].headers["Nats-Msg-Id"] == \
        f"delivered:{PARENT.agent}.{PARENT.name}:{METHOD}:{alone_id}"
    assert sorted(called) == sorted([s.run_id for s in states] + ["batch-alone"])
    assert hooks.stats.called == together + 1


async def test_a_republished_hook_waits_while_its_first_call_runs(log, tether):
    """Two publications of one outcome (the parent's, the reconciler's retry) reaching
    the handler while the first call is still running: the second does not call."""
    release = asyncio.Event()
    calls: list[str] = []

    async def slow(run: RunInfo, result: LifecycleResult) -> None:
        calls.append(run.run_id)
        await release.wait()

    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.register(METHOD, slow)
    async with hooks.running():
        state = await finished_run(log, "import-twice")
        await publish_hook(log, state, first=True)
        await eventually(lambda: calls, timeout=10, interval=0.01)
        await publish_hook(log, state, msg_id=finish_message_id(state, "completed", METHOD)
                           + ":retry1")
        # The retry found the claim and was put back.
        await eventually(lambda: hooks.stats.deferred != 0 or len(calls) != 1, timeout=10,
                         interval=0.01)
        release.set()
        await ledger_entry(log, "import-twice")
        await settled(tether, timeout=20)
    assert calls == ["import-twice"]
    assert hooks.stats.skipped == 1  # the retry, once the first call was recorded


async def test_a_republished_hook_waits_while_its_first_copy_is_being_checked(
        log, tether, monkeypatch):
    """Two publications of one outcome reaching the handler while the first is still
    reading the records (a slow broker): the second does not pass the check beside it."""
    release = asyncio.Event()
    checking = record_reads(monkeypatch, answer_after=release)
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")
    hooks.on_finish(METHOD)(recorder)
    async with hooks.running():
        state = await finished_run(log, "import-checked-twice")
        await publish_hook(log, state)
        await eventually(lambda: checking, timeout=10, interval=0.01)
        await publish_hook(log, state, msg_id=finish_message_id(state, "completed", METHOD)
                           + ":retry1")
        await eventually(lambda: hooks.stats.deferred != 0 or len(checking) != 1,
                         timeout=10, interval=0.01)
        release.set()
        await ledger_entry(log, "import-checked-twice")
        await settled(tether, timeout=20)
    assert len(recorder.calls) == 1 and hooks.stats.skipped == 1


async def test_serve_says_when_it_is_registered_and_serving_and_stops_when_told(log, tether):
    recorder = Recorder()
    hooks = tether.hooks(PARENT.agent, lease_ms=STEADY_LEASE_MS, ledger="direct")

    @hooks.on_finish(METHOD)
    async def on_import_done(run: RunInfo, result: LifecycleResult) -> None:
        await recorder(run, result)

    stop = asyncio.Event()
    serving = asyncio.create_task(hooks.serve(stop))
    await asyncio.wait_for(hooks.ready.wait(), timeout=10)
    # Ready means registered: the parent would accept a run naming the method now.
    bucket = await tether.js.key_value(tether.subjects.registry_bucket)
    assert await bucket.get(f"hook.{PARENT.agent}.{METHOD}")
    await publish_hook(log, await finished_run(log, "import-served"))
    await asyncio.wait_for(recorder.called.wait(), timeout=10)
    stop.set()
    await asyncio.wait_for(serving, timeout=10)
    assert not hooks.ready.is_set()
    assert [run.run_id for run, _, _ in recorder.calls] == ["import-served"]
