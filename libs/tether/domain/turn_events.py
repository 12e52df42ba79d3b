"""The event of a follow-up turn: a finished run asked again (`run.turn_requested`).
Exported by `tether.domain.events` too."""

from typing import Annotated, Any, Literal

from msgspec import Meta
from pydantic import Field

from tether.domain.detached_options import DetachedOptions
from tether.domain.event_envelope import EventEnvelope, NonNegative, Positive, ShortText, tag_types
from tether.domain.records import Record


class RunTurnRequestedData(Record, frozen=True, kw_only=True):
    """A follow-up turn of a finished run (`turn`, from 2): its input, and, as for a run
    request, its caller's tool call, its display and detached options and its time
    budgets (resolved by the parent). The run starts again with the same child, which
    keeps what it recorded."""

    turn: Annotated[int, Field(ge=2), Meta(ge=2)]
    input: dict[str, Any]
    parent_tool_call_id: ShortText | None = None
    detached: DetachedOptions | None = None
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative = 0


class RunTurnRequested(EventEnvelope, frozen=True, kw_only=True, tag="run.turn_requested"):
    schema_version: Literal[1] = 1
    data: RunTurnRequestedData


tag_types(RunTurnRequested)
