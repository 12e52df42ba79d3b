"""A command's expiry (`expires_in_ms`), counted from the stream's stamp on the broker's
clock, and its client-side argument in seconds."""

import pytest

from tether.client.arguments import expires_in_ms
from tether.domain.commands import MAX_EXPIRES_IN_MS, overdue_ms


def test_a_command_within_its_expiry_or_without_one_is_not_overdue():
    assert overdue_ms({"expires_in_ms": 1_000}, stored_at=5_000, now=6_000) is None
    assert overdue_ms({}, stored_at=5_000, now=10**12) is None
    assert overdue_ms(b"not an object", stored_at=5_000, now=10**12) is None


def test_a_command_past_its_expiry_is_overdue_by_how_late_it_is():
    assert overdue_ms({"expires_in_ms": 1_000}, stored_at=5_000, now=6_250) == 250


@pytest.mark.parametrize("malformed", [True, "1000", 0, -5, 1.5])
def test_a_malformed_expiry_is_left_to_the_commands_validation(malformed):
    assert overdue_ms({"expires_in_ms": malformed}, stored_at=0, now=10**12) is None


def test_the_client_takes_seconds_and_names_the_argument_when_out_of_range():
    assert expires_in_ms(None) is None
    assert expires_in_ms(2.5) == 2_500
    for wrong in (0, -1, MAX_EXPIRES_IN_MS):
        with pytest.raises(ValueError, match="expires_in must be more than 0"):
            expires_in_ms(wrong)

