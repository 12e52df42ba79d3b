"""A hook handler holding a hook while its function runs, against real JetStream: the
server hands the hook out again when the handler's renewal came late (a process paused
mid-call, an in-progress acknowledgement lost), and to the handler itself when its fetch
is the one waiting. That handler goes on with the new delivery: it does not put the hook
back, where another replica would take it and call the function a second time."""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from eventually import eventually
from hook_handlers import METHOD, PARENT, finish_detached_run, publish_finish_hook

from tether.adapters.deliveries import DeliveryRecords, delivery_key, held_mark
from tether.adapters.event_log import EventLog
from tether.adapters.holds import Hold
from tether.adapters.pull import delivery_of, durable_pull
from tether.adapters.tenant_deliveries import TenantDeliveryRecords
from tether.client import Tether, connect
from tether.client.hooks import consumer_config
from tether.contract.messages import LifecycleResult, RunInfo

LEASE_S = 1.0


@pytest.fixture
async def tether(log: EventLog, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


async def finish_delivered(log: EventLog, run_id: str) -> int:
    history = await log.read_run(PARENT, run_id)
    return [event.type for event in history.events].count("run.finish_delivered")


async def test_a_hook_handed_again_to_the_handler_calling_it_is_not_passed_on(log, tether):
    calls: list[str] = []
    returns = asyncio.Event()

    async def import_done(run: RunInfo, result: LifecycleResult) -> None:
        calls.append(run.run_id)
        await returns.wait()

    hooks = tether.hooks(PARENT.agent, lease_ms=int(LEASE_S * 1000), ledger="direct")
    hooks.register(METHOD, import_done)
    # The handler's fetches, and another replica's, from the method's consumer.
    pull = await durable_pull(tether.js, tether.nc, tether.subjects.hooks_stream,
                              consumer_config(tether.subjects, PARENT.agent, METHOD,
                                              lease_s=LEASE_S, max_ack_pending=32))
    handling: asyncio.Task | None = None
    try:
        await finish_detached_run(log, "import-1")
        await publish_finish_hook(log, "import-1")
        [first] = await pull.fetch(1, timeout=10)
        # Handled without a hold, so never renewed: the renewal of a paused process, late.
        handling = asyncio.create_task(hooks.handle(METHOD, first))
        await eventually(lambda: calls)
        [again] = await pull.fetch(1, timeout=10)  # past the lease, to the same handler
        assert delivery_of(again).delivered == 2
        await hooks.handle(METHOD, again, Hold(time.monotonic(), LEASE_S))

        # Another replica asking now gets nothing within half a lease (no event says so).
        with pytest.raises(TimeoutError):
            await pull.fetch(1, timeout=LEASE_S / 2)
        returns.set()
        await handling
        await eventually(lambda: finish_delivered(log, "import-1"))

        async def acknowledged() -> bool:
            """Nothing left to deliver or to acknowledge (the server takes acknowledgements
            in on a queue of its own: a look right after one may not show it yet)."""
            info = await tether.js.consumer_info(tether.subjects.hooks_stream, pull.durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        await eventually(acknowledged)  # through the newest delivery
    finally:
        returns.set()
        if handling is not None:
            await handling
        await pull.unsubscribe()
    assert calls == ["import-1"]
    assert await finish_delivered(log, "import-1") == 1


@pytest.mark.parametrize("store", ["services", "tenant"])
async def test_a_mark_put_late_leaves_the_delivered_record_another_replica_made(
        log: EventLog, nc, store: str):
    """A handler woken from a pause mid-call renews its mark after the replica that took
    the hook over recorded it delivered: the record stays, else the reconciler would take
    the hook for undelivered and publish it again."""
    bucket = log.subjects.deliveries_bucket
    records = (await DeliveryRecords.open(log.jetstream, bucket) if store == "services"
               else TenantDeliveryRecords(nc, log.subjects))
    message_id = "hook-of-r1"
    await records.mark_held(PARENT, METHOD, message_id, "completed", 1000)  # replica A
    await records.mark_held(PARENT, METHOD, message_id, "completed", 1000)  # B, taking over
    kv = await log.jetstream.key_value(bucket)
    assert held_mark((await kv.get(delivery_key(PARENT, METHOD, message_id))).value, 0)
    await records.record(PARENT, METHOD, message_id, "completed")  # B's call ended
    await records.mark_held(PARENT, METHOD, message_id, "completed", 1000)  # A wakes
    assert await records.recorded(PARENT, METHOD, message_id)
