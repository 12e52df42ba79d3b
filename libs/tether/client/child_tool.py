"""A child agent as a tool in a parent model's tool list.

`definition()` is what the parent model is shown; `execute(parent, tool_call_id, input)`
is what the application runs when the model calls the tool: an awaited run with run id
`agent-tool:<tool_call_id>`, so a retried tool call never starts a second child turn. It
returns the child's summary on success and the `AgentToolFailure` as a dict otherwise,
both ready to go back to the model as the tool result.
"""

import json
import re
from typing import Any, Protocol

from pydantic import BaseModel, Field, ValidationError, create_model

from tether.agents.tools import Tool
from tether.child.agent import AnyInput
from tether.child.context import current_context
from tether.client.errors import MessageRefused
from tether.contract.messages import AgentToolFailure, AgentToolSuccess, DetachedHandle
from tether.domain.detached_options import DetachedOptions
from tether.domain.ids import check_identifier, framework_run_id, tool_run_id

FOLLOW_UP_HELP = ("the run_id an earlier call of this tool answered with, to ask that run "
                  "again (it remembers); leave it out to start a new one")
_TOOL_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_TOOL_NAME = 64  # what OpenAI-style function names allow
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": True}


class ToolParent(Protocol):
    """The parent an agent tool's calls run for (`tether.client.parent.ParentHandle`)."""

    async def run_agent_tool(
        self, agent_type: str, input: dict[str, Any] | BaseModel | None = None, *,
        run_id: str | None = None, parent_tool_call_id: str | None = None,
        display_order: int | None = None, display: str | None = None,
        detached: bool | dict[str, Any] | DetachedOptions = False,
        timeout: float | None = None,
    ) -> AgentToolSuccess | AgentToolFailure | DetachedHandle: ...


def tool_name(agent_type: str) -> str:
    return _TOOL_NAME_UNSAFE.sub("_", agent_type)[:_MAX_TOOL_NAME]


class AgentTool:
    """A child agent as one tool of a parent model.

    In an `AgentDefinition`'s tools it becomes a `Tool` (`as_tool()`) that starts the run
    from the model parent's own run: awaited by default, or, with `detached` (True or the
    options of `run_agent_tool(detached=...)`), started in the background, the model
    getting the handle at once and the outcome through `notify` or `on_finish`.
    """

    def __init__(self, agent_type: str, *, description: str, name: str | None = None,
                 display_name: str | None = None,
                 input_model: type[BaseModel] | None = None,
                 detached: bool | dict[str, Any] = False, follow_ups: bool = False) -> None:
        """`follow_ups`: the model may name (`follow_up`) the run of an earlier call of
        this tool to ask it again, a follow-up turn, instead of starting a new one."""
        self.agent_type = check_identifier(agent_type, "agent type")
        if not description or not description.strip():
            raise ValueError(f"the {agent_type} tool needs a description for the parent model")
        self.description = description
        self.name = name if name is not None else tool_name(agent_type)
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ValueError(f"invalid tool name {self.name!r}: 1 to 64 letters, digits, '_' or '-'")
        self.display_name = display_name or agent_type
        self.input_model = input_model
        self.detached = detached
        self.follow_ups = follow_ups
        self.parent: ToolParent | None = None

    def __repr__(self) -> str:
        return f"AgentTool({self.name!r}, agent_type={self.agent_type!r})"

    @property
    def input_schema(self) -> dict[str, Any]:
        if self.input_model is None and not self.follow_ups:
            return dict(ANY_OBJECT_SCHEMA)
        return self._call_model().model_json_schema()

    def _call_model(self) -> type[BaseModel]:
        """What the model gives a call: the input model's fields, and `follow_up` when the
        tool takes follow-ups."""
        base = self.input_model or AnyInput
        if not self.follow_ups:
            return base
        return create_model(f"{base.__name__}Call", __base__=base, follow_up=(
            str | None, Field(default=None, description=FOLLOW_UP_HELP)))

    def definition(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function definition."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": self.input_schema}}

    def bind(self, parent: "ToolParent") -> "AgentTool":
        """A copy whose `execute` may leave the parent out."""
        bound = AgentTool(self.agent_type, description=self.description, name=self.name,
                          display_name=self.display_name, input_model=self.input_model,
                          detached=self.detached, follow_ups=self.follow_ups)
        bound.parent = parent
        return bound

    async def execute(self, parent: "ToolParent | None", tool_call_id: str,
                      input: dict[str, Any] | str | BaseModel | None,
                      display_order: int | None = None) -> str | dict[str, Any]:
        """Run the child for one tool call: its summary, or the failure as a dict.

        `input` may be the model's raw JSON arguments; input that does not fit the input
        model comes back as a non-retryable failure, for the model to correct.
        """
        parent = parent or self.parent
        if parent is None:
            raise ValueError(f"{self!r} is not bound to a parent: pass one to execute()")
        run_id = tool_run_id(tool_call_id)
        try:
            arguments, follow_up = self._arguments(input)
        except (ValueError, TypeError) as error:
            return {"ok": False, "run_id": run_id, "agent_type": self.agent_type,
                    "status": "error", "error": f"invalid input: {error}", "retryable": False}
        options: dict[str, Any] = {"detached": self.detached} if self.detached else {}
        if follow_up is not None:  # the run of an earlier call, asked again
            options["follow_up"] = follow_up
        else:
            options["run_id"] = run_id
        result = await parent.run_agent_tool(
            self.agent_type, arguments, parent_tool_call_id=tool_call_id,
            display_order=display_order, display=self.display_name, **options)
        if isinstance(result, AgentToolSuccess):
            return result.summary
        return result.model_dump(mode="json", exclude_none=True)

    def as_tool(self) -> Any:
        """This agent tool as a `tether.agents.Tool`, for a model parent's definition.

        Its calls start runs owned by the model parent's run (`ctx.client`, the
        child-runner's parent client), one per tool call, and run concurrently.
        """
        async def execute(ctx: Any, input: BaseModel) -> Any:
            run = current_context()
            if run is None or run.client is None:
                raise RuntimeError(f"the {self.name} tool starts a Tether run: it works in a "
                                   "model parent run by a child-runner with a parent client")
            # Through the run's context: an awaited run that waits for a human is relayed
            # up the tree (`RunContext.run_agent_tool`).
            return await self.execute(run, ctx.tool_call_id,  # type: ignore[arg-type]
                                      input.model_dump(mode="json", exclude_unset=True))

        return Tool(id=self.name, description=self.description,
                    input_model=self._call_model(), execute=execute, starts_run=True)

    def _arguments(self, input: dict[str, Any] | str | BaseModel | None
                   ) -> tuple[dict[str, Any], str | None]:
        """The run's input, and the run a follow-up asks again (None: a new run)."""
        if isinstance(input, str):
            try:
                input = json.loads(input) if input.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"not JSON: {error}") from None
        if isinstance(input, BaseModel):
            input = input.model_dump(mode="json")
        input = {} if input is None else input
        if not isinstance(input, dict):
            raise TypeError(f"expected a JSON object, not {type(input).__name__}")
        follow_up = None
        if self.follow_ups:
            input = dict(input)
            follow_up = input.pop("follow_up", None)
            if follow_up is not None and not isinstance(follow_up, str):
                raise TypeError("follow_up: the run_id of an earlier call, a string")
        if self.input_model is None:
            return input, follow_up
        try:
            return self.input_model.model_validate(input).model_dump(mode="json"), follow_up
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'input'}: {p['msg']}"
                                 for p in error.errors())
            raise ValueError(problems) from None


def agent_tool(agent: Any, *, description: str | None = None, display_name: str | None = None,
               input_model: type[BaseModel] | None = None, name: str | None = None,
               detached: bool | dict[str, Any] = False,
               follow_ups: bool | None = None) -> AgentTool:
    """An `AgentTool` for a child agent, named by its agent type or given as its class.

    With a `ChildAgent` subclass, its `agent_type`, `description` and `input_model` are the
    defaults (a class without an input model of its own takes any object), and the tool
    takes follow-ups (`follow_ups`) when the class does (`ChildAgent.follow_ups`).
    """
    if isinstance(agent, type):
        agent_type = getattr(agent, "agent_type", "") or agent.__name__
        description = description or getattr(agent, "description", "") or ""
        declared = getattr(agent, "input_model", None)
        if input_model is None and declared not in (None, AnyInput):
            input_model = declared
        if follow_ups is None:
            follow_ups = bool(getattr(agent, "follow_ups", ()))
    else:
        agent_type = agent
    return AgentTool(agent_type, description=description or "", name=name,
                     display_name=display_name, input_model=input_model, detached=detached,
                     follow_ups=bool(follow_ups))


class MessageInput(BaseModel):
    """What a model parent's `message_tool` takes."""

    run_id: str = Field(description="the run to tell: the run_id a detached agent tool "
                                    "answered with")
    text: str = Field(min_length=1, description="what to tell its agent")
    interrupt: bool = Field(default=False, description="stop what it is doing now and take "
                                                       "the message in (default: at its next "
                                                       "step)")


def message_tool(*, name: str = "message_run", description: str | None = None) -> Tool:
    """A tool a model parent sends its running children messages with (steering): the
    model names a run it started (a detached agent tool's `run_id`) and what to tell it.
    The message's id is the tool call's, so a call made again (the model parent's run
    resumed after a crash) records it once."""
    async def execute(ctx: Any, input: MessageInput) -> str:
        run = current_context()
        if run is None or run.client is None:
            raise RuntimeError(f"the {name} tool sends a Tether message: it works in a model "
                               "parent run by a child-runner with a parent client")
        try:
            receipt = await run.client.send(
                input.run_id, input.text, mode="interrupt" if input.interrupt else "queue",
                message_id=framework_run_id("message", ctx.tool_call_id))
        except MessageRefused as refused:
            return f"not sent: {refused}"
        when = "now" if receipt.mode == "interrupt" else "at its next step"
        return f"sent to run {input.run_id}: its agent takes the message in {when}"

    return Tool(id=name, input_model=MessageInput, execute=execute, description=description or (
        "Send a message to a run you started and that is still running (a detached agent "
        "tool's run_id): to steer it, add to its task or correct it."))
