"""A runner's hold on a work item and its attempt's standing (`tether.domain.attempts`)."""


from tether.domain import attempts
from tether.domain.run_state import fold
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
