"""What a run's child recorded beside its steps, and where a fork took it from: its
milestones and the answers to its pauses (kept in a run's state), where a fork was taken
(`Forked`, and the `ForkPoint` asked for; what it reuses is `run.requested`'s
`ForkOrigin`)."""

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tether.domain.event_envelope import NonNegative, RunRef, ShortText
from tether.domain.records import Record


class Milestone(Record, frozen=True, kw_only=True):
    sequence: int
    name: str
    data: Any = None
    at: int


class Resumption(Record, frozen=True, kw_only=True):
    """A human's or a tool's answer to a pause, as `tether.cmd.continue` delivered it."""

    pause_id: str
    decisions: dict[str, Any]
    at: int


class Forked(Record, frozen=True, kw_only=True):
    """The run a fork was taken from (`run`, of the same parent), the last of its events
    the fork reuses (`seq`, its stream sequence), how the point was asked for (`at`:
    `step:<n>`, `milestone:<name>` or `seq:<n>`), and what the fork changes in how its
    agent runs (`overrides`, as the agent's `ChildAgent.overrides_model` reads them)."""

    run: RunRef
    seq: NonNegative
    at: ShortText
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)


PointKind = Literal["step", "milestone", "seq"]


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """Where to fork: before step `n` (`step`: steps 0..n-1 are reused), right after the
    first milestone of a name (`milestone`), or after the event at a stream sequence
    (`seq`, as the UI's slider shows it)."""

    kind: PointKind
    value: int | str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"

    @classmethod
    def parse(cls, text: str) -> "ForkPoint":
        """`step:<n>`, `milestone:<name>`, `seq:<n>`, or a number alone (a step)."""
        kind, colon, value = text.partition(":")
        if not colon:
            kind, value = "step", text
        if kind == "milestone" and value:
            return cls("milestone", value)
        if kind in ("step", "seq") and value.isdigit():
            return cls(kind, int(value))  # type: ignore[arg-type]
        raise ValueError(f"at: expected step:<n>, milestone:<name> or seq:<n> (a number alone "
                         f"is a step), not {text!r}")
