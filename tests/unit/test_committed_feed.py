"""The projector's committed batches for the reconciler of its process: a subscription
covers the log from where the projector stood when it was taken, in order, until the
projector's term ends or the subscriber lets too much wait."""

import asyncio

from tether.adapters.postgres.committed_feed import CommittedFeed
from tether.domain.evolved import Evolved
from tether.ports import StoredEvent


def batch(*seqs: int) -> list[StoredEvent]:
    return [StoredEvent(seq=seq, subject="t.evt.A.b.r", event=None, error=None, raw=b"")
            for seq in seqs]


async def taken(subscription) -> list[list[int]]:
    return [[stored.seq for stored in got.events] async for got in subscription.batches()]


def test_no_subscription_while_the_projector_does_not_lead():
    feed = CommittedFeed()
    assert feed.subscribe() is None
    feed.led(10)
    feed.ended("stopped")
    assert feed.subscribe() is None and not feed.leading


async def test_a_subscription_starts_where_the_projector_stands_and_ends_with_its_term():
    feed = CommittedFeed()
    feed.led(10)
    feed.committed(batch(11, 12))  # before the subscription: not in it
    subscription = feed.subscribe()
    assert subscription is not None and subscription.start == 12
    feed.committed(batch(13))
    feed.committed([])  # a batch the projector had had already: nothing
    feed.committed(batch(14, 14, 15))  # (a ledger message's entries share a sequence)
    feed.ended("the projector's term ended")
    assert await taken(subscription) == [[13], [14, 14, 15]]
    assert subscription.end_reason == "the projector's term ended"


async def test_a_subscriber_waits_for_the_next_commit():
    feed = CommittedFeed()
    feed.led(0)
    subscription = feed.subscribe()
    assert subscription is not None
    waiting = asyncio.ensure_future(anext(subscription.batches()))
    await asyncio.sleep(0)
    assert not waiting.done()
    feed.committed(batch(1))
    assert [stored.seq for stored in (await waiting).events] == [1]


async def test_a_subscriber_that_lets_too_much_wait_is_ended_and_given_nothing_more():
    feed = CommittedFeed(max_pending=3)
    feed.led(0)
    subscription = feed.subscribe()
    assert subscription is not None
    feed.committed(batch(1, 2))
    feed.committed(batch(3, 4))  # 4 waiting: more than 3
    feed.committed(batch(5))
    assert await taken(subscription) == []
    assert subscription.end_reason == "more than 3 events waited to be taken"
    fresh = feed.subscribe()  # the feed goes on for others
    assert fresh is not None and fresh.start == 5


async def test_a_closed_subscription_ends_and_receives_nothing():
    feed = CommittedFeed()
    feed.led(0)
    subscription, other = feed.subscribe(), feed.subscribe()
    assert subscription is not None and other is not None
    subscription.close()
    feed.committed(batch(1))
    feed.ended("stopped")
    assert await taken(subscription) == []
    assert await taken(other) == [[1]]


async def test_a_batch_carries_the_projectors_fold_of_each_event_when_it_made_one():
    feed = CommittedFeed()
    feed.led(0)
    subscription = feed.subscribe()
    assert subscription is not None
    steps = [Evolved(None, True), None]
    feed.committed(batch(1, 2), steps)
    feed.committed(batch(3))  # folded by another writer: the subscriber folds it itself
    feed.ended("stopped")
    got = [(item.events, item.evolutions) async for item in subscription.batches()]
    assert [evolutions for _, evolutions in got] == [steps, None]
