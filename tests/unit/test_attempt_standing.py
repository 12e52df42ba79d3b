"""A runner's hold on a work item and its attempt's standing (`tether.domain.attempts`)."""


import asyncio
import time

from tether.adapters.holds import Hold, StallWatch
from tether.domain import attempts
from tether.domain.fold import fold
from tether.testing import RunEvents


def test_a_hold_is_fresh_for_two_thirds_of_the_ack_wait_after_its_renewal():
    assert attempts.hold_fresh(now=106.0, renewed_at=100.0, ack_wait_s=10.0)
    assert not attempts.hold_fresh(now=106.7, renewed_at=100.0, ack_wait_s=10.0)
    # A runner paused for 15 s past a 10 s ack wait wakes with a stale hold.
    assert not attempts.hold_fresh(now=115.0, renewed_at=100.0, ack_wait_s=10.0)


def test_an_attempts_standing_follows_the_run():
    run = RunEvents("r1")
    state = fold([run.requested(), run.running(attempt=1)])
    life = state.incarnation

    assert attempts.standing(state, 1, life) == "current"
    assert attempts.standing(fold([run.running(attempt=2)], state), 1, life) == "superseded"
    assert attempts.standing(fold([run.completed()], state), 1, life) == "ended"
    assert attempts.standing(state, 1, "another life") == "gone"
    assert attempts.standing(None, 1, life) == "gone"
    # Taken over and then ended by the newer attempt: superseded, not ended.
    taken = fold([run.running(attempt=2), run.completed()], state)
    assert attempts.standing(taken, 1, life) == "superseded"
    assert attempts.standing_detail(taken, "superseded") == "attempt 2 took over the run"


def test_an_item_was_handed_out_no_earlier_than_its_arrival_less_the_stalls_before_it():
    # Read 0.9 s after a long poll was sent, with no stall: handed out at its arrival.
    assert attempts.delivered_no_earlier_than(100.0, 100.9, stalled_s=0.0) == 100.9
    # Read after a 15 s stall: it may have waited in the socket all along.
    assert attempts.delivered_no_earlier_than(100.0, 116.0, stalled_s=15.0) == 101.0
    # Never before the request that brought it.
    assert attempts.delivered_no_earlier_than(100.0, 101.0, stalled_s=5.0) == 100.0


async def test_a_stalled_loop_is_noticed_and_voids_the_hold_of_what_arrived_after_it():
    watch = StallWatch()
    watch.start()
    try:
        requested = time.monotonic()
        await asyncio.sleep(0.15)  # a tick, so the watch is under way
        time.sleep(0.6)  # noqa: ASYNC251 - the fault: the loop stalls, as a paused process's does
        arrived = time.monotonic()
        stalled = watch.stalled_s(requested, arrived)
        hold = Hold.of_delivery(requested, arrived, ack_wait_s=0.9, watch=watch)
        quiet = Hold.of_delivery(arrived, arrived, ack_wait_s=0.9, watch=watch)
    finally:
        watch.stop()

    assert 0.5 <= stalled <= 0.8, stalled
    assert not hold.fresh  # handed out before the stall: 0.75 s > two thirds of 0.9 s
    assert quiet.fresh
