"""The client's ordered feed (timelines, chat, scoped run reads) against real JetStream."""

import asyncio

from tether.adapters.jetstream import EventLog
from tether.client.feed import OrderedFeed
from tether.domain.events import ParentRef
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


async def consumer_names(log: EventLog) -> set[str]:
    infos = await log.jetstream.consumers_info(log.subjects.events_stream)
    return {info.name for info in infos}


async def test_a_feed_names_its_consumer_so_permissions_can_see_its_filter(log: EventLog):
    async with OrderedFeed(log.jetstream, log.subjects.events_stream,
                           log.subjects.parent_events(PARENT)):
        (name,) = await consumer_names(log)
        assert name.startswith("feed-")


async def test_a_feed_goes_on_under_a_new_name_after_a_gap(log: EventLog):
    """nats-py re-creates an ordered consumer from the next sequence when a delivery
    reveals a gap, while the first one still exists: under the same name and a changed
    configuration the server refused it, and the feed went silent."""
    run = RunEvents("gap", PARENT)
    subject = log.subjects.run_events(PARENT, run.run_id)
    async with OrderedFeed(log.jetstream, log.subjects.events_stream, subject,
                           name="mine") as feed:
        await log.append(run.requested(), expected_last_seq=0)
        first = await asyncio.wait_for(feed.sink.get(), 5)
        # What nats-py's read loop does on a gap (or missed heartbeats).
        assert await feed._subscription._sub._jsi.reset_ordered_consumer(first.seq + 1)
        await log.append(run.started(), expected_last_seq=None)
        second = await asyncio.wait_for(feed.sink.get(), 5)
        assert (second.seq, second.subject) == (first.seq + 1, subject)
        assert {"mine", "mine-2"} <= await consumer_names(log)
        # And again: every incarnation has a name of its own.
        assert await feed._subscription._sub._jsi.reset_ordered_consumer(second.seq + 1)
        await log.append(run.running(), expected_last_seq=None)
        third = await asyncio.wait_for(feed.sink.get(), 5)
        assert third.seq == second.seq + 1
        assert "mine-3" in await consumer_names(log)
