"""What a parent asks for when it starts a detached run: the hook its outcome goes to, the
notices its chat gets (`NotifyOptions`, `MilestoneNotifyOptions`) and its time budgets
(`DetachedOptions`), as `run.requested` and `run.turn_requested` carry them."""

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from pydantic import Field, GetCoreSchemaHandler
from pydantic_core import CoreSchema, core_schema

from tether.domain.event_envelope import NonNegative, Positive
from tether.domain.ids import Identifier, check_identifier
from tether.domain.records import CheckedRecord


class NotifyOptions(CheckedRecord, frozen=True, kw_only=True):
    source: Annotated[str, Field(min_length=1, max_length=128),
                      Meta(min_length=1, max_length=128)] = "agent-tool"


class MilestoneNotifyOptions(CheckedRecord, frozen=True, kw_only=True):
    names: list[Identifier]
    mode: Literal["narrate", "react"] = "narrate"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.names:
            check_identifier(name, "milestone name")


class DetachedOptions(CheckedRecord, frozen=True, kw_only=True):
    """What the parent wants when a detached run finishes or passes a milestone.

    `no_progress_budget_ms` of 0 or infinity disables the no-progress budget; infinity is
    stored as 0 because JSON has no infinity.
    """

    on_finish: Identifier | None = None
    notify: bool | NotifyOptions = False
    on_milestones: list[Identifier] | MilestoneNotifyOptions | None = None
    max_budget_ms: Positive | None = None
    no_progress_budget_ms: NonNegative | None = None

    def __post_init__(self) -> None:
        if _is_infinity(self.no_progress_budget_ms):
            msgspec.structs.force_setattr(self, "no_progress_budget_ms", 0)
        super().__post_init__()
        if self.on_finish is not None:
            check_identifier(self.on_finish, "on_finish")
        if isinstance(self.on_milestones, list):
            for name in self.on_milestones:
                check_identifier(name, "milestone name")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(
            _finite_budget, super().__get_pydantic_core_schema__(source, handler))

    def milestone_names(self) -> list[str]:
        if self.on_milestones is None:
            return []
        if isinstance(self.on_milestones, MilestoneNotifyOptions):
            return list(self.on_milestones.names)
        return list(self.on_milestones)

    def milestone_mode(self) -> Literal["narrate", "react"]:
        if isinstance(self.on_milestones, MilestoneNotifyOptions):
            return self.on_milestones.mode
        return "narrate"


def _is_infinity(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value) and value > 0


def _finite_budget(value: Any) -> Any:
    if isinstance(value, dict) and _is_infinity(value.get("no_progress_budget_ms")):
        return {**value, "no_progress_budget_ms": 0}
    return value
