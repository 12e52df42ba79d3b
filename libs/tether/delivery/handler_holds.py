"""Whether a hook handler is still calling a hook's function, from what a retry sees of
its mark (`adapters/deliveries.py`, `HeldMark`) over time.

A handler calling a function renews its mark at least every third of its lease, so a
mark whose revision moved since the last look is alive, and one that kept a revision
for two leases is not (its handler died, or stopped, mid-call). A mark seen for the first
time counts as alive: a retry waits one more look before it republishes, never longer.
Times are seconds of the retrier's monotonic clock, passed in, so no wall clock (the
handler's or the retrier's) moves the answer.
"""

from dataclasses import dataclass

# How many of the mark's leases a revision may stay unchanged before its handler counts
# as gone: one for the renewal itself, one for the moment between a look and a renewal.
LEASES_UNRENEWED = 2


@dataclass(frozen=True, slots=True)
class Sighting:
    revision: int
    first_seen_s: float


def still_held(revision: int, lease_ms: int, last: Sighting | None,
               now_s: float) -> tuple[bool, Sighting]:
    """Whether the mark at `revision` is a call under way, and what to remember of it for
    the next look (`last`: what the previous look remembered)."""
    if last is None or last.revision != revision:
        return True, Sighting(revision, now_s)
    return now_s - last.first_seen_s < LEASES_UNRENEWED * lease_ms / 1000, last
