"""The event of a rewind: a failed run taken up again from its last recorded step, as a
new attempt of the same run (`run.rewound`). Exported by `tether.domain.events` too. (A
fork is a new run: its `run.requested` says where it was taken from, `ForkOrigin`.)"""

from typing import Literal

from tether.domain.event_envelope import EventEnvelope, NonNegative, Positive, tag_types
from tether.domain.records import Record


class RunRewoundData(Record, frozen=True, kw_only=True):
    """The failure rewound (`error`), and the steps kept: all the run had recorded, its
    child going on after the last as a resumed child does. The run starts again as a new
    life of its run id (its outcome's hooks and notices are the new life's)."""

    error: str
    steps: NonNegative
    # Its time budgets from now, as for a run request (resolved by the parent).
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative = 0


class RunRewound(EventEnvelope, frozen=True, kw_only=True, tag="run.rewound"):
    schema_version: Literal[1] = 1
    data: RunRewoundData


tag_types(RunRewound)
