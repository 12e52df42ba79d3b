"""The physical ceilings of this machine, measured with the messages W1 actually wrote.

Straight from the drivers, no Tether code: JetStream append (nats-py async publish with
bounded in-flight acks, and one-at-a-time sync publish for reference), JetStream consume
(batched pull fetch + ack, and an ordered push consumer replay), and Postgres writes of
one row per event with asyncpg COPY. Each uses a scratch stream / schema of its own that
is deleted afterwards; the payloads and subjects are W1's own events.
"""

import asyncio
import json
import time

import asyncpg
import nats
from nats.aio.client import Client as NATS
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError, ServiceUnavailableError

from tether.contract.subjects import Subjects

SYNC_PUBLISH_CAP = 20_000  # one-at-a-time publishes are slow; enough for a stable rate


async def read_log(nc: NATS, subjects: Subjects, expected: int) -> tuple[list[tuple[str, bytes]], float]:
    """Every message of the events stream via an ordered consumer; (messages, seconds)."""
    js = nc.jetstream()
    messages: list[tuple[str, bytes]] = []
    done = asyncio.Event()

    async def on_message(msg) -> None:
        messages.append((msg.subject, msg.data))
        if len(messages) >= expected:
            done.set()

    begin = time.perf_counter()
    subscription = await js.subscribe(subjects.all_events, stream=subjects.events_stream,
                                      cb=on_message, ordered_consumer=True,
                                      config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL))
    await asyncio.wait_for(done.wait(), 300)
    seconds = time.perf_counter() - begin
    await subscription.unsubscribe()
    return messages, seconds


async def append_async(nc: NATS, stream: str, messages: list[tuple[str, bytes]],
                       in_flight: int) -> float:
    js = nc.jetstream(publish_async_max_pending=in_flight)
    begin = time.perf_counter()
    for subject, data in messages:
        await js.publish_async(subject, data)
    await js.publish_async_completed()
    return len(messages) / (time.perf_counter() - begin)


async def append_sync(nc: NATS, messages: list[tuple[str, bytes]]) -> float:
    js = nc.jetstream()
    begin = time.perf_counter()
    for subject, data in messages:
        await js.publish(subject, data)
    return len(messages) / (time.perf_counter() - begin)


async def fetch_ack(nc: NATS, stream: str, count: int, batch: int) -> float:
    js = nc.jetstream()
    durable = "ceiling-fetch"
    await js.add_consumer(stream, js_api.ConsumerConfig(
        durable_name=durable, ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL, max_ack_pending=batch * 4))
    subscription = await js.pull_subscribe_bind(durable=durable, stream=stream)
    received = 0
    begin = time.perf_counter()
    starting_until = time.monotonic() + 30
    while received < count:
        try:
            batch_msgs = await subscription.fetch(batch, timeout=2)
        except (FetchTimeoutError, TimeoutError):
            break
        except ServiceUnavailableError:
            # In a cluster a new consumer's replicas may not serve yet ("no responders"):
            # try again, and time the fetches from the first that is served.
            if received or time.monotonic() > starting_until:
                raise
            await asyncio.sleep(0.05)
            begin = time.perf_counter()
            continue
        for msg in batch_msgs:
            await msg.ack()
        received += len(batch_msgs)
    seconds = time.perf_counter() - begin
    await subscription.unsubscribe()
    return received / seconds


async def ordered_replay(nc: NATS, stream: str, filter_subject: str, count: int) -> float:
    js = nc.jetstream()
    received = 0
    done = asyncio.Event()

    async def on_message(msg) -> None:
        nonlocal received
        received += 1
        if received >= count:
            done.set()

    begin = time.perf_counter()
    subscription = await js.subscribe(filter_subject, stream=stream, cb=on_message,
                                      ordered_consumer=True,
                                      config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL))
    await asyncio.wait_for(done.wait(), 300)
    seconds = time.perf_counter() - begin
    await subscription.unsubscribe()
    return count / seconds


async def copy_rows(database_url: str, schema: str, messages: list[tuple[str, bytes]]) -> float:
    """COPY one row per event (sequence, run id, type, the event as jsonb)."""
    rows = []
    for seq, (subject, data) in enumerate(messages, start=1):
        event = json.loads(data)
        rows.append((seq, subject, event.get("run_id"), event.get("type"), data.decode()))
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'CREATE TABLE "{schema}".events (seq bigint PRIMARY KEY, '
                           'subject text NOT NULL, run_id text, type text, event jsonb NOT NULL)')
        begin = time.perf_counter()
        async with conn.transaction():
            await conn.copy_records_to_table("events", schema_name=schema, records=rows)
        seconds = time.perf_counter() - begin
        return len(rows) / seconds
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


async def measure(nats_url: str, database_url: str, subjects: Subjects, expected: int, *,
                  in_flight: int = 1024, fetch_batch: int = 500, replicas: int = 1) -> dict:
    """Every ceiling with the `expected` messages of the events stream (W1's log), on a
    scratch stream of `replicas` replicas (as many as the events stream's)."""
    nc = await nats.connect(nats_url.split(","), name="tether-bench-ceilings")
    js = nc.jetstream()
    scratch = f"{subjects.prefix.upper()}_CEILING"
    prefix = f"{subjects.prefix}ceiling"
    try:
        messages, log_read_s = await read_log(nc, subjects, expected)
        evt = f"{subjects.prefix}.evt."
        mapped = [(prefix + "." + s.removeprefix(evt), d) for s, d in messages]
        await js.add_stream(js_api.StreamConfig(
            name=scratch, subjects=[f"{prefix}.>"], storage=js_api.StorageType.FILE,
            retention=js_api.RetentionPolicy.LIMITS, num_replicas=replicas,
            allow_direct=True))
        try:
            append = await append_async(nc, scratch, mapped, in_flight)
            fetch = await fetch_ack(nc, scratch, len(mapped), fetch_batch)
            replay = await ordered_replay(nc, scratch, f"{prefix}.>", len(mapped))
            await js.purge_stream(scratch)
            sync = await append_sync(nc, mapped[:SYNC_PUBLISH_CAP])
        finally:
            await js.delete_stream(scratch)
        copy = await copy_rows(database_url, f"{subjects.prefix}_ceiling", messages)
    finally:
        await nc.drain()
    sizes = [len(d) for _, d in messages]
    return {"messages": len(messages), "mean_bytes": sum(sizes) / max(len(sizes), 1),
            "append_async_per_s": append, "append_in_flight": in_flight, "replicas": replicas,
            "append_sync_per_s": sync, "append_sync_messages": min(len(mapped), SYNC_PUBLISH_CAP),
            "fetch_ack_per_s": fetch, "fetch_batch": fetch_batch,
            "ordered_replay_per_s": replay, "tether_log_replay_per_s": len(messages) / log_read_s,
            "copy_rows_per_s": copy}
