"""What a child agent is: the class an application subclasses, its input, its pauses.

A child agent is a Python class registered by import path (`TETHER_AGENTS`,
`--agents module:Class`). Its `agent_type` defaults to the class name.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from tether.child.context import report_progress as report_current_progress
from tether.domain.ids import check_identifier

if TYPE_CHECKING:
    from tether.child.context import RunContext


class AnyInput(BaseModel):
    """The input model of a child that declares none: any JSON object."""

    model_config = ConfigDict(extra="allow")


PAUSE_MILESTONES = {"waiting_for_human": "needs-approval",
                    "waiting_for_tools": "needs-tool-output"}


@dataclass(frozen=True)
class AwaitingInput:
    """What `run` returns to pause the run until `tether.cmd.continue` answers it.

    The runner appends `run.paused` (with `pending`) and a milestone named after the
    reason (`needs-approval` or `needs-tool-output`, its data holding the pause id and
    the pending items, so a detached run's parent can react), acknowledges the work item
    and records no outcome. The parent's `run.resumed` re-dispatches the run; the runner
    that picks it up runs the child again, with the answers in
    `ctx.history.resumptions[-1].decisions`.

    `key` names this pause among the run's pauses, and must be the same when a resumed
    attempt pauses again at the same point (it becomes part of the event id).
    """

    reason: Literal["waiting_for_human", "waiting_for_tools"]
    key: str
    pending: list[dict[str, Any]] = field(default_factory=list)


class ChildAgent:
    """Subclass and implement `run`; docs/concepts.md describes the full surface.

    `run` returns the child's final text (the default summary), or a structured value
    (the output), or None, or an `AwaitingInput` to pause the run. Workflow-style
    children with no text override `get_output` and `get_summary`, which are read once
    `run` has returned.
    """

    agent_type: ClassVar[str] = ""
    description: ClassVar[str] = ""
    input_model: ClassVar[type[BaseModel]] = AnyInput
    # The cap on this child's own agent tools when it acts as a parent (None: the
    # service's `max_concurrent_agent_tools`).
    max_concurrent_agent_tools: ClassVar[int | None] = None
    # The version of this agent's code, recorded on each attempt (`run.running`): a build
    # id or a release. Empty: a digest of the file that defines the class
    # (`tether.agent_registry.agent_version`).
    version: ClassVar[str] = ""
    # The budget of this agent's runs in model tokens and cost, over each run and the runs
    # below it, when a request sets none (None: no budget); and what one of its runs
    # started under a budgeted run reserves of that budget when it has no budget of its
    # own (`tether.domain.spending`).
    max_tokens: ClassVar[int | None] = None
    max_cost: ClassVar[float | None] = None
    estimated_tokens: ClassVar[int] = 0
    estimated_cost: ClassVar[float] = 0.0
    # The statuses after which a run of this agent takes a follow-up turn (`completed`,
    # `error`, `interrupted`); none by default. A follow-up runs `run` again with the new
    # input, `ctx.turn` its number and `ctx.history` what the earlier turns recorded.
    follow_ups: ClassVar[frozenset[str]] = frozenset()
    # What a fork of one of its runs may change in how it runs (`RunCommand.fork`'s
    # `overrides`, checked against this model; `ctx.overrides` in the fork); None: a
    # fork changes its input or code only.
    overrides_model: ClassVar[type[BaseModel] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("agent_type"):
            cls.agent_type = cls.__name__
        check_identifier(cls.agent_type, "agent type")

    async def run(self, ctx: "RunContext", input: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx, input)")

    @classmethod
    def check_configuration(cls) -> None:
        """Raise `AgentConfigurationError` when this process cannot run the agent (a
        child-runner asks every agent when it starts, so it refuses to start rather than
        fail each run). Nothing to check by default."""

    async def get_output(self, run_id: str) -> Any:
        return None

    async def report_progress(self, fraction: float | None = None, message: str | None = None,
                              phase: str | None = None, milestone: str | None = None,
                              data: Any = None, persist: bool = False) -> None:
        """`ctx.report_progress` for the run this agent is executing, found from the task.

        Code that has no `ctx` at hand (a tool function deep inside the child) can report
        through the agent; run standalone, this is a no-op with a development warning.
        """
        await report_current_progress(fraction=fraction, message=message, phase=phase,
                              milestone=milestone, data=data, persist=persist)

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return None


