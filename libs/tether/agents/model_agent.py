"""A child agent that thinks: an AgentDefinition run by the child-runner.

    class Researcher(ModelAgent):
        definition = AgentDefinition(id="researcher", model="gpt-4o-mini", tools=(search,))

Each completed step is appended to the run's log as `run.step_recorded` before the next
one starts, and the answer's text streams into `run.output`. A runner that picks the
run up again (after a crash, or after a continue) rebuilds the conversation from the
recorded steps and goes on after the last one. A tool call that needs approval, or a
tool that runs outside the agent, pauses the run (`AwaitingInput`); the parent's
`tether.cmd.continue` brings the decisions, read here from the run's last resumption.

The model client is chosen per runner process: the class's `model_client`, else the
import path in TETHER_MODEL_CLIENT (`module:attribute`, a client or a factory taking the
agent class), else a scripted client playing the class's `script` (demos, tests).
"""

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tether.agent_registry import AgentConfigurationError
from tether.agents.clients.scripted import Entry, ScriptedModelClient
from tether.agents.definition import AgentDefinition
from tether.agents.in_process import build_result, input_messages
from tether.agents.loop import AgentLoop
from tether.agents.loop_ports import CallPlan, Inbox, LoopPorts, Session, StepJournal, TextSink
from tether.agents.model_messages import Message, ModelClient
from tether.agents.results import AgentRunResult
from tether.agents.steps import AgentStepRecord, Decisions, RunStatus, state_after
from tether.agents.tools import StateAccessor
from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.context import RunContext
from tether.domain.events import ParentRef
from tether.ports import SYSTEM_CLOCK

MODEL_CLIENT_VARIABLE = "TETHER_MODEL_CLIENT"
SCRIPTED_CALLS_VARIABLE = "TETHER_SCRIPTED_CALLS_FILE"


class ModelAgentInput(BaseModel):
    """What a parent sends a model agent: the task, and optional run options."""

    input: str = Field(min_length=1, description="the task or question for the agent")
    context: dict[str, Any] = Field(default_factory=dict,
                                    description="application context for tools and instructions")
    model: str | None = Field(default=None, description="overrides the definition's model")
    max_steps: int | None = Field(default=None, ge=1, description="model turns per call")
    state: dict[str, Any] = Field(default_factory=dict, description="initial run state")
    preset: str | None = Field(default=None, description="a gateway preset, passed through")
    tool_execution: Literal["auto", "manual"] = Field(
        default="auto", description="manual: every tool call waits for its output from the "
                                    "parent (tether.cmd.continue with tool_outputs)")


class ModelAgentOverrides(BaseModel):
    """What a fork of a model agent's run may change (`RunCommand.fork`'s `overrides`): its
    instructions, model and model turns per call. The fork's recorded steps are kept; the
    model is called with these from the fork point on."""

    model_config = ConfigDict(extra="forbid")

    instructions: str | None = Field(default=None, min_length=1)
    model: str | None = Field(default=None, min_length=1)
    max_steps: int | None = Field(default=None, ge=1)


@dataclass(frozen=True)
class AgentToolRequest:
    """The run a model child's first message is shaped for (`format_agent_tool_input`)."""

    run_id: str
    agent_type: str
    parent: ParentRef
    parent_tool_call_id: str | None = None


class ModelAgentFailed(Exception):
    """The agent's run failed (a model error after its retries); the run ends `error`."""


class _RunJournal:
    """Step records go to the run's log; each one names the milestones reported in it.

    Each recorded step is also reported as progress, so the parent's view shows what the
    agent is doing, and a detached run's no-progress budget sees it working.
    """

    def __init__(self, ctx: RunContext, records: Sequence[AgentStepRecord]) -> None:
        self._ctx = ctx
        # Recorded steps are not run again, so their milestones are not reported again.
        ctx.replay_milestones([name for record in records for name in record.milestones])
        self._seen = len(ctx.reported_milestones)

    async def record(self, record: AgentStepRecord) -> AgentStepRecord:
        reported = self._ctx.reported_milestones
        record = record.model_copy(update={"milestones": reported[self._seen:]})
        self._seen = len(reported)
        await self._ctx.record_step(record.index, record.model_dump(mode="json"))
        await self._ctx.report_progress(phase=record.kind, message=step_message(record))
        return record


def step_message(record: AgentStepRecord) -> str:
    tools = ", ".join(dict.fromkeys(r.tool_name for r in record.tool_results)) or "no tools"
    if record.steering:
        count = len(record.steering)
        return f"step {record.index + 1}: took in {count} message{'s' * (count > 1)} " \
               "from the parent"
    if record.kind == "continuation":
        return f"step {record.index + 1}: answers to paused calls ({tools})"
    if record.status == "completed":
        return f"step {record.index + 1}: answered"
    return f"step {record.index + 1}: {tools} -> {record.status}"


class ModelAgent(ChildAgent):
    definition: ClassVar[AgentDefinition]
    # A completed run takes a follow-up turn: the conversation goes on with its input.
    follow_ups: ClassVar[frozenset[str]] = frozenset({"completed"})
    # A fork may change its instructions, model and model turns per call.
    overrides_model: ClassVar[type[BaseModel] | None] = ModelAgentOverrides
    input_model: ClassVar[type[BaseModel]] = ModelAgentInput
    model_client: ClassVar[ModelClient | None] = None
    script: ClassVar[Sequence[Entry | Sequence[Entry]] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        definition = cls.__dict__.get("definition")
        if definition is not None and not cls.__dict__.get("description"):
            cls.description = definition.description
        if cls.__dict__.get("base_class"):
            return  # a base for model agents of a kind (ModelParent), not an agent itself
        if not isinstance(getattr(cls, "definition", None), AgentDefinition):
            raise AgentConfigurationError(f"{cls.__name__}: set `definition = AgentDefinition(...)`")

    def __init__(self) -> None:
        self.result: AgentRunResult | None = None

    @classmethod
    def check_configuration(cls) -> None:
        """Its model client can be made (`client_for`): a runner without one refuses to
        start instead of failing every run."""
        if not cls.__dict__.get("base_class"):
            client_for(cls)

    def run_input(self, input: BaseModel) -> ModelAgentInput:
        """Map this agent's input model to the run's options; a subclass with its own input
        model gets the input as JSON text, and its fields as the context."""
        if isinstance(input, ModelAgentInput):
            return input
        return ModelAgentInput(input=input.model_dump_json(), context=input.model_dump(mode="json"))

    def format_agent_tool_input(self, input: BaseModel, request: AgentToolRequest) -> str | Message:
        """The run's first user message: by default the task (`input`) of a
        `ModelAgentInput`, or the input as JSON for an agent with its own input model.
        Override to word it (a str, or a `Message`)."""
        return self.run_input(input).input

    async def run(self, ctx: RunContext, input: BaseModel) -> Any:
        definition = type(self).definition
        if ctx.overrides:  # a fork that changes how the agent runs from its fork point on
            changes = ModelAgentOverrides.model_validate(ctx.overrides)
            definition = replace(definition, **changes.model_dump(exclude_none=True))
        options = self.run_input(input)
        request = AgentToolRequest(
            run_id=ctx.run_id, agent_type=ctx.agent_type, parent=ctx.parent,
            parent_tool_call_id=ctx.history.parent_tool_call_id if ctx.history else None)
        history = ctx.history
        turns = history.turns if history is not None else ()
        # A follow-up turn goes on with the conversation: the run's first input opens it,
        # this turn's is the user's next message.
        opening_input = (self.input_model.model_validate(turns[0].input) if turns else input)
        first = self.format_agent_tool_input(opening_input, request)
        opening = None
        if turns:
            said = self.format_agent_tool_input(input, request)
            opening = said if isinstance(said, str) else said.content
        records = ([AgentStepRecord.model_validate(history.steps[i]) for i in sorted(history.steps)]
                   if history is not None else [])
        resumptions = history.resumptions if history is not None else ()
        this_turn = len(resumptions) - (history.turn_first_resumption if history else 0)
        decisions = Decisions.of(**resumptions[-1].decisions) if this_turn > 0 else None
        plan = CallPlan(run_id=ctx.run_id, call=len(resumptions) + len(turns),
                        max_steps=options.max_steps or definition.max_steps,
                        retry=definition.model_retries, model=options.model,
                        preset=options.preset, tool_execution=options.tool_execution,
                        context=options.context, parent=ctx.parent, opening=opening)
        initial = self.run_input(opening_input).state
        session = Session(input=input_messages(first), records=records,
                          state=StateAccessor(state_after(initial, records)))

        async def text(chunk: str, replayed: bool) -> None:
            # Replayed text is already in the run's output; the recorder recognises it.
            await ctx.output(chunk)

        def status(value: str) -> None:
            ctx.child_status = value

        ports = run_ports(ctx, client_for(type(self)), _RunJournal(ctx, records), text=text,
                          inbox=ctx if ctx.in_run else None, on_status=status)
        outcome = await AgentLoop(definition, ports).drive(session, plan, decisions)
        started = history.started_at if history is not None and history.started_at else SYSTEM_CLOCK.now()
        result = self.result = build_result(definition, plan, session, outcome, started)
        if result.status == "cancelled":
            ctx.raise_if_cancelled()
        if result.status == "failed":
            raise ModelAgentFailed(result.error or "the model call failed")
        if result.pause is not None:
            pending = [call.model_dump(mode="json") for call in result.pause.pending]
            # By the step and the answers so far: a successor pauses at the same point
            # with the same id, a continue that answered nothing pauses with a new one.
            return AwaitingInput(reason=result.pause.reason, pending=pending,
                                 key=f"step-{result.pause.step_index}:{len(resumptions)}")
        return {"status": result.status, "output": result.output,
                "stop_reason": result.stop_reason, "model": result.record.model,
                "max_steps": result.record.max_steps, "steps": len(result.steps),
                "usage": result.usage.model_dump(mode="json")}

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        if self.result is None:
            return None
        if self.result.output:
            return self.result.output
        return f"stopped: {self.result.stop_reason}" if self.result.stop_reason else ""


def run_ports(ctx: RunContext, client: ModelClient, journal: StepJournal, *,
              text: TextSink, inbox: Inbox | None,
              on_status: Callable[[RunStatus], None]) -> LoopPorts:
    """The agent loop's ports in a Tether run: its progress, cancel and status are the
    run's, and each model call and tool call passes the attempt's gate first
    (`RunContext.ensure_current`)."""
    return LoopPorts(client=client, journal=journal, text=text, progress=ctx.report_progress,
                     cancelled=ctx.cancelled, inbox=inbox, on_status=on_status,
                     ensure_current=ctx.ensure_current)


_clients: dict[tuple[str, type], ModelClient] = {}


def client_for(agent_cls: type[ModelAgent]) -> ModelClient:
    """This process's model client for an agent class (created once, then reused)."""
    if agent_cls.model_client is not None:
        return agent_cls.model_client
    path = os.environ.get(MODEL_CLIENT_VARIABLE, "")
    key = (path, agent_cls)
    if key not in _clients:
        _clients[key] = _load_client(path, agent_cls) if path else _scripted(agent_cls)
    return _clients[key]


def _scripted(agent_cls: type[ModelAgent]) -> ModelClient:
    if agent_cls.script is None:
        raise AgentConfigurationError(
            f"{agent_cls.__name__}: no model client; set {MODEL_CLIENT_VARIABLE}=module:attribute "
            f"(e.g. tether.agents.clients.openai_compatible:from_env) or give the class a script")
    return ScriptedModelClient(agent_cls.script,
                               calls_file=os.environ.get(SCRIPTED_CALLS_VARIABLE) or None)


def _load_client(path: str, agent_cls: type[ModelAgent]) -> ModelClient:
    module_name, _, attribute = path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise AgentConfigurationError(f"{MODEL_CLIENT_VARIABLE}={path!r}: {error}") from None
    if hasattr(found, "complete"):
        return found
    try:
        client = found(agent_cls)
    except AgentConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - a factory's own failure, said as such
        raise AgentConfigurationError(
            f"{MODEL_CLIENT_VARIABLE}={path!r} could not make a client for "
            f"{agent_cls.__name__}: {type(error).__name__}: {error}") from None
    if not hasattr(client, "complete"):
        raise AgentConfigurationError(f"{MODEL_CLIENT_VARIABLE}={path!r} did not give a model "
                                      "client (an object with `complete`)")
    return client
