"""Each override of the services' fast client (`tether.adapters.nats_fastpath`) against
nats-py's own client, over a real server: the same scenario through both gives the same
observable behaviour. (The header parse and the publish bytes: tests/unit/test_nats_parsing.py.)
"""

import asyncio
from contextlib import aclosing, suppress

import pytest
from nats.aio.client import Client as NATS

from tether.adapters import arrivals as arrivals_module
from tether.adapters import event_log as event_log_module
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.nats_fastpath import FastClient
from tether.adapters.requests import subscribe_routed
from tether.testing import RunEvents

pytestmark = pytest.mark.usefixtures("tested_nats_py")


@pytest.fixture
async def clients(settings):
    fast = await connect_nats(settings.nats_url, name="fast", fast_path=True)
    plain = await connect_nats(settings.nats_url, name="plain", fast_path=False)
    assert type(fast) is FastClient and type(plain) is NATS
    yield fast, plain
    for client in (fast, plain):
        await client.drain()


async def test_connect_nats_gives_the_fast_client_only_when_asked(clients):
    fast, plain = clients
    assert isinstance(fast, FastClient) and not isinstance(plain, FastClient)


async def receive_each(nc: NATS, subject: str, sender: NATS, count: int) -> list[tuple]:
    """`count` subscriptions in turn (as awaited runs come and go), each receiving one
    message with headers and a reply subject, then unsubscribed."""
    got: list[tuple] = []
    for n in range(count):
        arrived = asyncio.Event()

        def route(msg, arrived=arrived) -> None:
            if not arrived.is_set():
                got.append((msg.subject, msg.reply, msg.data, msg.headers))
                arrived.set()

        subscription = await subscribe_routed(nc, subject, route)
        await nc.flush()
        # Core delivery is at most once; to a just-made subscription one in a few dozen
        # never arrived here (with nats-py's own callbacks too), so publish until one does.
        while not arrived.is_set():
            await sender.publish(subject, b"x%d" % n, reply=f"{subject}.reply.{n}",
                                 headers={"K": str(n), "Nats-Msg-Id": f"id-{n}"})
            with suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), 0.2)
        await subscription.unsubscribe()
    return got


async def test_a_routed_subscription_gets_what_a_callback_subscription_gets(clients, settings):
    fast, plain = clients
    subject = f"{settings.prefix}.routed"
    ours = await receive_each(fast, subject, plain, 30)
    theirs = await receive_each(plain, subject, plain, 30)
    assert ours == theirs
    assert [data for _, _, data, _ in ours] == [b"x%d" % n for n in range(30)]
    assert fast.routes == {}, "an unsubscribed route stays behind"
    # Nothing reaches a route after its unsubscribe.
    late: list[bytes] = []
    subscription = await subscribe_routed(fast, f"{subject}.late", lambda msg: late.append(msg.data))
    await subscription.unsubscribe()
    await plain.publish(f"{subject}.late", b"after")
    await plain.flush()
    await fast.flush()
    assert late == [] and fast.routes == {}


async def test_received_messages_count_in_the_stats_as_nats_py_counts_them(clients, settings):
    subject = f"{settings.prefix}.counted"
    got = {nc: [] for nc in clients}
    done = asyncio.Event()
    for nc in clients:
        def route(msg, nc=nc) -> None:
            got[nc].append(msg.data)
            if all(len(received) == 5 for received in got.values()):
                done.set()

        await subscribe_routed(nc, subject, route)
        await nc.flush()
    before = {nc: dict(nc.stats) for nc in clients}
    for n in range(5):
        await clients[1].publish(subject, b"%d" % n * (n + 1), headers={"K": "v"})
    await asyncio.wait_for(done.wait(), 10)
    deltas = [(nc.stats["in_msgs"] - before[nc]["in_msgs"],
               nc.stats["in_bytes"] - before[nc]["in_bytes"]) for nc in clients]
    assert deltas[0] == deltas[1] == (5, 15)


async def follow_two(log: EventLog, run: RunEvents) -> list[tuple]:
    subject = log.subjects.run_events(run.parent, run.run_id)
    got = []
    async with aclosing(log.follow(subject, idle_heartbeat=0.1)) as stream:
        got.append(await asyncio.wait_for(anext(stream), 10))
        await log.append(run.running(), expected_last_seq=None)
        got.append(await asyncio.wait_for(anext(stream), 10))
    return [(s.seq, s.subject, s.raw, s.event, s.error, s.pending) for s in got]


async def test_a_follower_gets_what_it_gets_on_nats_py_without_parsing_event_headers(
        clients, settings, log, monkeypatch):
    """Each stored event carries its append's headers (message id, expected sequence),
    which a follower never reads: the fast client does not parse them. The consumer's
    heartbeats, a status line and headers, still are; and the follower's events are the
    ones nats-py's own client gives."""
    fast, plain = clients
    parsed: list[bytes] = []
    heard = asyncio.Event()
    parse = FastClient._parse_header_lines

    def recording(raw: bytes) -> dict[str, str]:
        parsed.append(raw)
        heard.set()
        return parse(raw)

    monkeypatch.setattr(FastClient, "_parse_header_lines", staticmethod(recording))
    fast_log, plain_log = EventLog(fast, log.subjects), EventLog(plain, log.subjects)
    run, twin = RunEvents("r-quiet"), RunEvents("r-twin")
    for r in (run, twin):
        await log.append(r.requested(), expected_last_seq=None)
    ours = await follow_two(fast_log, run)
    theirs = await follow_two(plain_log, twin)
    assert [event.type for _, _, _, event, _, _ in ours] == ["run.requested", "run.running"]
    assert [(e.type, p) for *_, e, _, p in ours] == [(e.type, p) for *_, e, _, p in theirs]
    # The same follow on the fast client, waiting for an idle heartbeat in between.
    async with aclosing(fast_log.follow(log.subjects.run_events(run.parent, run.run_id),
                                        idle_heartbeat=0.1)) as stream:
        replayed = [await asyncio.wait_for(anext(stream), 10) for _ in range(2)]
        await asyncio.wait_for(heard.wait(), 10)  # an idle heartbeat, parsed
    assert [(s.seq, s.raw) for s in replayed] == [(seq, raw) for seq, _, raw, *_ in ours]
    assert parsed and all(b"Nats-Msg-Id" not in raw for raw in parsed), parsed


async def follow_all(log: EventLog, filter_subject: str, count: int, *, pause_s: float = 0.0,
                     max_batch: int = 1000, idle_heartbeat: float = 5.0,
                     during=None) -> list[tuple[int, str]]:
    """(seq, event id) of the first `count` events a follower gets, taking its batches
    `pause_s` apart; `during(n)` runs after each batch (n: events so far)."""
    got: list[tuple[int, str]] = []
    async with aclosing(log.follow_batches(filter_subject, max_batch=max_batch,
                                           idle_heartbeat=idle_heartbeat)) as batches:
        while len(got) < count:
            batch = await asyncio.wait_for(anext(batches), 20)
            got += [(s.seq, s.event.event_id) for s in batch]
            if during is not None:
                await during(len(got))
            await asyncio.sleep(pause_s)
    return got


async def append_runs(log: EventLog, runs: int) -> list[str]:
    events = [RunEvents(f"r-{n}").requested() for n in range(runs)]
    for start in range(0, runs, 100):
        await asyncio.gather(*(log.append(e, expected_last_seq=None)
                               for e in events[start:start + 100]))
    return [e.event_id for e in events]


async def test_a_followed_consumer_gets_the_events_nats_py_gets_in_order(clients, log):
    fast, plain = clients
    ids = await append_runs(log, 300)
    ours = await follow_all(EventLog(fast, log.subjects), log.subjects.all_events, 300)
    theirs = await follow_all(EventLog(plain, log.subjects), log.subjects.all_events, 300)
    assert ours == theirs
    assert [seq for seq, _ in ours] == sorted({seq for seq, _ in ours})
    assert sorted(event_id for _, event_id in ours) == sorted(ids)


async def test_a_full_follower_answers_flow_control_only_once_it_took_some(
        clients, log, monkeypatch):
    """A follower behind by its whole buffer holds the server's flow-control request
    (which the server waits for before it sends past its window) and answers it once it
    has taken events: every event still arrives once, in order."""
    fast, _ = clients
    monkeypatch.setattr(event_log_module, "FOLLOW_BUFFER", 40)
    held, released = [], []
    hold, release = arrivals_module.Arrivals.hold_flow_control, arrivals_module.Arrivals.release

    def recording_hold(self, reply: str) -> bool:
        kept = hold(self, reply)
        held.append(kept)
        return kept

    async def recording_release(self, nc) -> None:
        pending = self._held
        await release(self, nc)
        if pending is not None and self._held is None:
            released.append(pending)

    monkeypatch.setattr(arrivals_module.Arrivals, "hold_flow_control", recording_hold)
    monkeypatch.setattr(arrivals_module.Arrivals, "release", recording_release)
    ids = await append_runs(log, 3000)
    got = await follow_all(EventLog(fast, log.subjects), log.subjects.all_events, 3000,
                           max_batch=20, pause_s=0.002)
    assert sorted(event_id for _, event_id in got) == sorted(ids)
    assert [seq for seq, _ in got] == sorted({seq for seq, _ in got})
    assert True in held, "the follower was full when the server asked"
    assert released, "and answered once it had taken some"


async def test_a_followed_consumer_resumes_after_its_last_event_when_the_consumer_is_lost(
        clients, log):
    """The server forgets the consumer (deleted here; a restarted server without it):
    the missing heartbeats make nats-py's ordered consumer start a new one after the
    last event delivered, and the follower goes on with no event lost or repeated."""
    fast, _ = clients
    follower = EventLog(fast, log.subjects)
    first = await append_runs(log, 50)
    later: list[str] = []

    async def lose_the_consumer_once(count: int) -> None:
        if count >= 50 and not later:
            info = await log.jetstream.streams_info()
            [stream] = [s for s in info if s.config.name == log.subjects.events_stream]
            for consumer in await log.jetstream.consumers_info(stream.config.name):
                await log.jetstream.delete_consumer(stream.config.name, consumer.name)
            later.extend(await append_runs_named(log, 50, "late"))

    got = await follow_all(follower, log.subjects.all_events, 100, idle_heartbeat=0.2,
                           during=lose_the_consumer_once)
    assert [event_id for _, event_id in got[:50]] and later
    assert sorted(event_id for _, event_id in got) == sorted(first + later)
    assert [seq for seq, _ in got] == sorted({seq for seq, _ in got})


async def append_runs_named(log: EventLog, runs: int, prefix: str) -> list[str]:
    events = [RunEvents(f"{prefix}-{n}").requested() for n in range(runs)]
    await asyncio.gather(*(log.append(e, expected_last_seq=None) for e in events))
    return [e.event_id for e in events]
