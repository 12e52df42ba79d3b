"""Events of one agent run, for `on_event` callbacks and streams."""

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import Field

from tether.agents.model_messages import Frozen

AgentEventType = Literal[
    "run_started",      # a run or continue call began
    "text_delta",       # a piece of the model's answer (`text`)
    "model_retry",      # a model call failed and will be retried after `delay_ms`
    "model_response",   # a model turn arrived
    "tool_started",
    "tool_finished",
    "step_recorded",    # a step record was stored; the run goes on from it
    "paused",           # waiting for a human or for tool outputs
    "run_finished",     # the call ended: completed, stopped, failed, cancelled or paused
]


class AgentEvent(Frozen):
    type: AgentEventType
    run_id: str
    at: int
    step: int | None = None
    text: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


OnEvent = Callable[[AgentEvent], "Awaitable[None] | None"]


def event_callback(on_event: OnEvent | None) -> Callable[[AgentEvent], Awaitable[None]]:
    """A sync or async callback as one async function (None: ignore events)."""

    async def deliver(event: AgentEvent) -> None:
        if on_event is None:
            return
        returned = on_event(event)
        if inspect.isawaitable(returned):
            await returned

    return deliver
