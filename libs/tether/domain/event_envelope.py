"""The envelope every event shares, and what it names: the run's parent (`ParentRef`), a
run (`RunRef`), and the constrained field types the events' data use.

The events themselves are in `tether.domain.events`, which exports every one of them (and
these) and tags each class with its `type`; a concept's events live in a module of their
own beside it (`steering_events`, `budget_events`, `turn_events`).
"""

from typing import Annotated, ClassVar

from msgspec import Meta
from pydantic import Field

from tether.domain.ids import EventId, Identifier, check_identifier
from tether.domain.records import Record

# Each constrained type carries msgspec's constraint (records) and pydantic's (the models
# that hold records, and commands).
EpochMs = Annotated[int, Field(ge=0, description="milliseconds since the Unix epoch"),
                    Meta(ge=0, description="milliseconds since the Unix epoch")]
Fraction = Annotated[float, Field(ge=0.0, le=1.0), Meta(ge=0.0, le=1.0)]
Positive = Annotated[int, Field(gt=0), Meta(gt=0)]
NonNegative = Annotated[int, Field(ge=0), Meta(ge=0)]
Count = Annotated[int, Field(ge=1), Meta(ge=1)]
Money = Annotated[float, Field(ge=0.0), Meta(ge=0.0)]
PositiveMoney = Annotated[float, Field(gt=0.0), Meta(gt=0.0)]
ShortText = Annotated[str, Field(max_length=256), Meta(max_length=256)]


class ParentRef(Record, frozen=True, kw_only=True):
    """The parent agent instance that owns a run: its class (`agent`) and instance name."""

    agent: Identifier
    name: Identifier

    def __post_init__(self) -> None:
        check_identifier(self.agent, "parent agent")
        check_identifier(self.name, "parent name")


class RunRef(Record, frozen=True, kw_only=True):
    """One run: its parent and its run id (a run id is unique per parent only)."""

    parent: ParentRef
    run_id: Identifier

    def __post_init__(self) -> None:
        check_identifier(self.run_id, "run id")


class EventEnvelope(Record, frozen=True, kw_only=True, tag_field="type"):
    type: ClassVar[str]  # the tag, set on each event class by `tag_types`
    event_id: EventId
    schema_version: int
    run_id: Identifier
    parent: ParentRef
    occurred_at: EpochMs
    correlation_id: str | None = None
    causation_id: str | None = None
    data: Record

    def __post_init__(self) -> None:
        check_identifier(self.run_id, "run_id")


def tag_types(*classes: type[EventEnvelope]) -> None:
    """Set each event class's `type` to its tag."""
    for cls in classes:
        cls.type = str(cls.__struct_config__.tag)
