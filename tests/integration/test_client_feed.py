"""The client's ordered feed (timelines, chat, scoped run reads) against real JetStream."""

import asyncio

import pytest
from eventually import eventually
from nats.aio.msg import Msg

from tether.adapters.event_log import EventLog
from tether.client.feed import OrderedFeed
from tether.domain.events import ParentRef
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


async def consumer_names(log: EventLog) -> set[str]:
    infos = await log.jetstream.consumers_info(log.subjects.events_stream)
    return {info.name for info in infos}


async def test_a_feed_names_its_consumer_so_permissions_can_see_its_filter(log: EventLog):
    async with OrderedFeed(log.nats, log.subjects.events_stream,
                           log.subjects.parent_events(PARENT)):
        (name,) = await consumer_names(log)
        assert name.startswith("feed-")


async def _has(log: EventLog, consumer: str) -> bool:
    return consumer in await consumer_names(log)


async def next_message(feed: OrderedFeed):
    return await asyncio.wait_for(feed.sink.get(), 5)


async def test_a_feed_goes_on_under_a_new_name_when_its_consumer_is_lost(log: EventLog):
    """The server loses the consumer (deleted here; a restart of a server without it
    does the same): its heartbeats stop, and the feed creates one under a new name from
    the next sequence, since the server refuses a create that changes an existing
    consumer and the lost one may still be there until it is inactive."""
    run = RunEvents("lost", PARENT)
    subject = log.subjects.run_events(PARENT, run.run_id)
    async with OrderedFeed(log.nats, log.subjects.events_stream, subject, name="mine",
                           idle_heartbeat=0.1) as feed:
        await log.append(run.requested(), expected_last_seq=0)
        first = await next_message(feed)
        for incarnation in ("mine-2", "mine-3"):  # every incarnation has a name of its own
            await log.jetstream.delete_consumer(log.subjects.events_stream, feed.consumer)
            await eventually(lambda name=incarnation: _has(log, name), timeout=5)
            await log.append(run.started(), expected_last_seq=None)
            second = await next_message(feed)
            assert (second.seq, second.subject) == (first.seq + 1, subject)
            first = second
        assert feed.sink.empty()


async def lost_delivery(log: EventLog, feed: OrderedFeed, last_seq: int) -> None:
    """Consumer sequence 4 reaches the feed where 3 was next (the read loop hands it
    over as it would the server's: NATS refuses a client's publish with a `$JS.ACK`
    reply)."""
    reply = f"$JS.ACK.{log.subjects.events_stream}.mine.1.{last_seq + 5}.4.1700000000000000000.0"
    await feed._receive(Msg(log.nats, subject=feed._filter, reply=reply, data=b"{}"))


async def heartbeat_ahead(log: EventLog, feed: OrderedFeed, last_seq: int) -> None:
    """A heartbeat saying the consumer sent 4 messages where the feed received 2."""
    await log.nats.publish(feed._subscription.subject, b"",
                           headers={"Status": "100", "Description": "Idle Heartbeat",
                                    "Nats-Last-Consumer": "4", "Nats-Last-Stream": "9"})


@pytest.mark.parametrize("gap", [lost_delivery, heartbeat_ahead])
async def test_a_gap_in_the_deliveries_makes_the_feed_start_again_after_what_it_has(
        log: EventLog, gap):
    """A delivery lost on the way (as a client drops messages of a slow subscription):
    the feed takes nothing more from that incarnation and goes on from the next stream
    sequence it has not put on its sink, so nothing is skipped and nothing comes twice."""
    run = RunEvents("gap", PARENT)
    subject = log.subjects.run_events(PARENT, run.run_id)
    async with OrderedFeed(log.nats, log.subjects.events_stream, subject,
                           name="mine") as feed:
        await log.append(run.requested(), expected_last_seq=0)
        first = await next_message(feed)
        await log.append(run.started(), expected_last_seq=None)
        second = await next_message(feed)
        await gap(log, feed, second.seq)
        await eventually(lambda: _has(log, "mine-2"), timeout=5)
        await log.append(run.running(), expected_last_seq=None)
        third = await next_message(feed)
        assert (first.seq + 1, second.seq + 1) == (second.seq, third.seq)
        assert feed.sink.empty()


async def test_a_feed_delivers_what_nats_pys_ordered_consumer_delivers(log: EventLog):
    """The same stream content, replayed then live, through the feed and through
    nats-py's own ordered consumer: the same messages in the same order."""
    runs = [RunEvents(f"same-{i}", PARENT) for i in range(3)]
    for run in runs:
        await log.append(run.requested(), expected_last_seq=0)
    theirs: asyncio.Queue = asyncio.Queue()

    async def keep(msg) -> None:
        theirs.put_nowait((msg.metadata.sequence.stream, msg.subject, msg.data))

    filter_subject = log.subjects.parent_events(PARENT)
    subscription = await log.jetstream.subscribe(filter_subject, cb=keep, ordered_consumer=True)
    try:
        async with OrderedFeed(log.nats, log.subjects.events_stream, filter_subject) as feed:
            for run in runs:
                await log.append(run.started(), expected_last_seq=None)
            expected = [await asyncio.wait_for(theirs.get(), 5) for _ in range(6)]
            ours = [await next_message(feed) for _ in range(6)]
            assert [(m.seq, m.subject, m.data) for m in ours] == expected
            assert [m.pending for m in ours][-1] == 0
    finally:
        await subscription.unsubscribe()
