"""Stop conditions: functions of the step state that say whether to stop, and why.

They are checked after each model turn whose tool calls ran (a final answer ends the run
anyway). A condition that holds ends the call with status `stopped` and its reason;
a later continue call goes on from there.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.agents.steps import AgentStepRecord
    from tether.agents.usage import UsageSummary


@dataclass(frozen=True)
class StopState:
    step: "AgentStepRecord"  # the step just taken
    steps: "Sequence[AgentStepRecord]"  # every record of the run so far, this one included
    steps_this_call: int  # model turns taken by this run or continue call
    usage: "UsageSummary"
    state: Mapping[str, Any]
    context: Any


StopCondition = Callable[[StopState], tuple[bool, str]]


def step_count_is(count: int) -> StopCondition:
    """Stop once this call has taken `count` model turns."""

    def condition(state: StopState) -> tuple[bool, str]:
        return state.steps_this_call >= count, f"step count reached {count}"

    return condition


def tool_called(tool_id: str) -> StopCondition:
    """Stop right after the model called `tool_id` (e.g. a `final_answer` tool)."""

    def condition(state: StopState) -> tuple[bool, str]:
        called = any(call.name == tool_id for call in state.step.tool_calls)
        return called, f"tool {tool_id} was called"

    return condition


def total_tokens_exceed(limit: int) -> StopCondition:
    def condition(state: StopState) -> tuple[bool, str]:
        return state.usage.total_tokens > limit, f"total tokens exceeded {limit}"

    return condition


def cost_exceeds(limit: float) -> StopCondition:
    """Stop when the estimated cost passes `limit` (never, while the cost is unknown)."""

    def condition(state: StopState) -> tuple[bool, str]:
        cost = state.usage.cost
        return cost is not None and cost > limit, f"cost exceeded {limit}"

    return condition
