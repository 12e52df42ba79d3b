"""When a leader may act: the freshness rule of `tether.domain.lease`."""

from tether.domain.lease import fresh, next_confirmation_at


def test_a_lease_is_fresh_for_one_check_interval_after_its_confirmation_was_sent() -> None:
    assert fresh(10.0, 10.0, 1.0)
    assert fresh(10.999, 10.0, 1.0)
    assert not fresh(11.0, 10.0, 1.0)
    assert not fresh(25.0, 10.0, 1.0)  # woken from a 15 s pause


def test_a_lease_never_confirmed_is_not_fresh() -> None:
    assert not fresh(10.0, None, 1.0)


def test_a_confirmation_from_the_future_proves_nothing() -> None:
    # Times come from one monotonic clock; one that did not is not trusted.
    assert not fresh(10.0, 10.5, 1.0)


def test_the_loop_confirms_half_an_interval_after_the_last_confirmation() -> None:
    assert next_confirmation_at(10.0, 1.0, 10.2) == 10.5


def test_the_loop_confirms_at_once_when_the_lease_is_stale() -> None:
    assert next_confirmation_at(10.0, 1.0, 25.0) == 25.0
    assert next_confirmation_at(None, 1.0, 3.0) == 3.0
