"""An agent definition: model, instructions, tools, limits, retries, review and sampling.

`model`, `instructions` and `sampling` may be fixed or dynamic: a dynamic value is a
function of the run (`DynamicContext`), sync or async, evaluated before each model turn,
so instructions can depend on the application context or on what the tools stored in
the run's state.
"""

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar, Union

from tether.agents.model_messages import Message, Sampling
from tether.agents.steps import Decisions, PendingToolCall
from tether.agents.stop import StopCondition
from tether.agents.tools import Tool
from tether.agents.usage import PriceTable
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

T = TypeVar("T")


@dataclass(frozen=True)
class DynamicContext:
    run_id: str
    agent_id: str
    context: Any
    state: Mapping[str, Any]
    step: int  # model turns already taken in the run
    messages: Sequence[Message]
    parent: ParentRef | None = None


Dynamic: TypeAlias = Union[T, Callable[[DynamicContext], Union[T, Awaitable[T]]]]  # noqa: UP007 - a generic alias


async def resolve(value: "Dynamic[T]", ctx: DynamicContext) -> T:
    if not callable(value):
        return value
    produced = value(ctx)
    return await produced if inspect.isawaitable(produced) else produced


@dataclass(frozen=True)
class ModelRetry:
    """Retries of a failed model call: `count` more attempts, exponential backoff.

    A provider's Retry-After replaces the backoff for that wait; any wait is capped at
    `max_backoff_ms`, so a run never sleeps longer than the operator allowed.
    """

    count: int = 2
    backoff_ms: int = 500
    multiplier: float = 2.0
    max_backoff_ms: int = 30_000

    def __post_init__(self) -> None:
        if self.count < 0 or self.backoff_ms < 0 or self.multiplier < 1 or self.max_backoff_ms < 0:
            raise ValueError(f"invalid model retry policy {self}")

    def delay_ms(self, failed_attempt: int, retry_after_ms: int | None) -> int:
        if retry_after_ms is not None:
            return min(retry_after_ms, self.max_backoff_ms)
        backoff = self.backoff_ms * self.multiplier ** (failed_attempt - 1)
        return int(min(backoff, self.max_backoff_ms))


@dataclass(frozen=True)
class ReviewRequest:
    """Tool calls that need a human's approval, as the review callback sees them."""

    run_id: str
    agent_id: str
    pending: tuple[PendingToolCall, ...]
    context: Any
    state: Mapping[str, Any]
    parent: ParentRef | None = None


# Returns decisions to go on at once (e.g. a policy, or a prompt in a terminal), or None
# to pause the run as waiting_for_human until a continue call brings the decisions.
HumanReview = Callable[[ReviewRequest], "Decisions | Awaitable[Decisions | None] | None"]


@dataclass(frozen=True)
class AgentDefinition:
    id: str
    model: "Dynamic[str]"
    instructions: "Dynamic[str]" = ""
    tools: tuple[Tool, ...] = ()
    max_steps: int = 10  # model turns per run call and per continue call
    model_retries: ModelRetry = field(default_factory=ModelRetry)
    human_review: HumanReview | None = None
    sampling: "Dynamic[Sampling]" = field(default_factory=Sampling)
    stop_when: tuple[StopCondition, ...] = ()
    prices: PriceTable = field(default_factory=PriceTable)
    # Tool output longer than this is cut to its head and tail (None: never).
    max_tool_output_chars: int | None = 20_000
    description: str = ""

    def __post_init__(self) -> None:
        check_identifier(self.id, "agent id")
        if self.max_steps < 1:
            raise ValueError(f"agent {self.id}: max_steps must be at least 1")
        # An agent tool (`tether.agent_tool(...)`) stands for the Tool it makes.
        object.__setattr__(self, "tools", tuple(t.as_tool() if hasattr(t, "as_tool") else t
                                                for t in self.tools))
        object.__setattr__(self, "stop_when", tuple(self.stop_when))
        ids = [t.id for t in self.tools]
        if duplicates := sorted({i for i in ids if ids.count(i) > 1}):
            raise ValueError(f"agent {self.id}: two tools are named {', '.join(duplicates)}")

    def tool(self, tool_id: str) -> Tool | None:
        return next((t for t in self.tools if t.id == tool_id), None)
