"""A retry's view of a hook handler's mark of its call (`delivery/handler_holds.py`)."""

import pytest

from tether.delivery.handler_holds import Sighting, still_held

pytestmark = pytest.mark.unit

LEASE_MS = 1_000


def test_a_mark_seen_for_the_first_time_is_a_call_under_way():
    assert still_held(7, LEASE_MS, None, now_s=100.0) == (True, Sighting(7, 100.0))


def test_a_renewed_mark_is_a_call_under_way_however_long_it_runs():
    assert still_held(8, LEASE_MS, Sighting(7, 100.0), now_s=500.0) == (True, Sighting(8, 500.0))


def test_a_mark_unrenewed_within_two_leases_may_still_be_renewed():
    assert still_held(7, LEASE_MS, Sighting(7, 100.0), now_s=101.9) == (True, Sighting(7, 100.0))


def test_a_mark_unrenewed_for_two_leases_is_a_handler_gone():
    held, _ = still_held(7, LEASE_MS, Sighting(7, 100.0), now_s=102.0)
    assert not held
