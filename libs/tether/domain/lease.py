"""When a leader may act: on a lease confirmed within the check interval.

A lease's holder confirms, every so often, that its database session still holds the
lock. A confirmation proves the lease was held when the confirming query was *sent*
(an answer that arrives after a pause proves nothing about the pause), so
`confirmed_at` is that moment. A new holder acts only a grace of more than two check
intervals after taking the lock; a holder that acts only within a check interval of its
last confirmation therefore acts before any successor could. Both times are read on the
monotonic clock of the process that acts: a wall clock stepped meanwhile does not move
them.
"""


def fresh(now_mono: float, confirmed_at: float | None, check_interval: float) -> bool:
    """Whether a lease last confirmed at `confirmed_at` may be acted on at `now_mono`."""
    if confirmed_at is None:
        return False
    return 0 <= now_mono - confirmed_at < check_interval


def next_confirmation_at(confirmed_at: float | None, check_interval: float,
                         now_mono: float) -> float:
    """When the holder's own loop confirms next: half an interval after the last
    confirmation, so an action usually finds it fresh; at once when it is stale already
    (the process was paused, or a confirmation failed to be sent)."""
    if not fresh(now_mono, confirmed_at, check_interval):
        return now_mono
    assert confirmed_at is not None
    return confirmed_at + check_interval / 2
