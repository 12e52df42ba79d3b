"""Tools an agent may call, and the run context and state accessor they receive."""

import inspect
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether.agents.model_messages import ToolSpec
from tether.child.context import report_progress as report_current_progress
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

ProgressReporter = Callable[..., Awaitable[None]]


class StateAccessor:
    """The run's application state, as tools read and change it.

    Values must be JSON-serialisable: the state is stored with every step record, so a
    run resumed in another process sees what the tools left in it.
    """

    def __init__(self, initial: Mapping[str, Any] | None = None) -> None:
        self._values: dict[str, Any] = dict(initial or {})

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def set(self, key: str, value: Any) -> None:
        try:
            self._values[key] = to_jsonable_python(value)
        except PydanticSerializationError as error:
            raise ValueError(f"state value for {key!r} must be JSON-serialisable: {error}") from None

    def update(self, values: Mapping[str, Any]) -> None:
        for key, value in values.items():
            self.set(key, value)

    def delete(self, key: str) -> None:
        self._values.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        return dict(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)


@dataclass
class ToolContext:
    """What a tool's `execute` receives besides its input."""

    run_id: str
    agent_id: str
    tool_call_id: str
    step: int
    state: StateAccessor
    context: Any = None  # the application's context, as given to run()
    parent: ParentRef | None = None  # the Tether parent that owns the run, if any
    progress: ProgressReporter | None = field(default=None, repr=False)

    async def report_progress(self, fraction: float | None = None, message: str | None = None,
                              phase: str | None = None, milestone: str | None = None,
                              data: Any = None, persist: bool = False) -> None:
        """The child API's `report_progress`; a no-op (with one warning) outside a Tether run."""
        reporter = self.progress or report_current_progress
        await reporter(fraction=fraction, message=message, phase=phase, milestone=milestone,
                       data=data, persist=persist)


Execute = Callable[[ToolContext, Any], Awaitable[Any]]
ApprovalRule = bool | Callable[[Any, ToolContext], "bool | Awaitable[bool]"]


@dataclass(frozen=True)
class Tool:
    """A tool: `execute(ctx, input)` gets the validated `input_model` instance.

    A tool without `execute` runs outside the agent (in the caller's code): a call to it
    pauses the run as `waiting_for_tools` until its output is supplied. `needs_approval`
    (a flag, or a rule on the input) pauses the run as `waiting_for_human` until the call
    is approved or rejected.

    `starts_run` marks a tool whose call starts a Tether run (an agent tool): the model
    turn is recorded before such calls run, so a resumed run never asks the model again
    for them, and the calls of one turn run concurrently.
    """

    id: str
    description: str
    input_model: type[BaseModel]
    execute: Execute | None = None
    needs_approval: ApprovalRule = False
    starts_run: bool = False

    def __post_init__(self) -> None:
        # Tool names travel in provider APIs that accept only [A-Za-z0-9_-].
        check_identifier(self.id, "tool id")
        if ":" in self.id:
            raise ValueError(f"tool id {self.id!r} may not contain ':'")

    def spec(self) -> ToolSpec:
        return ToolSpec(id=self.id, description=self.description,
                        parameters=self.input_model.model_json_schema())

    async def requires_approval(self, input: BaseModel, ctx: ToolContext) -> bool:
        rule = self.needs_approval
        if not callable(rule):
            return bool(rule)
        decided = rule(input, ctx)
        return bool(await decided) if inspect.isawaitable(decided) else bool(decided)


def tool(function: Execute | None = None, *, id: str | None = None,
         description: str | None = None, needs_approval: ApprovalRule = False) -> Any:
    """Make a Tool of `async def name(ctx: ToolContext, input: SomeModel)`.

    The id defaults to the function's name, the description to its docstring, and the
    input model is read from the second parameter's annotation.
    """

    def make(fn: Execute) -> Tool:
        parameters = list(inspect.signature(fn).parameters)
        hints = get_type_hints(fn)
        model = hints.get(parameters[1]) if len(parameters) >= 2 else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"tool {fn.__name__}: annotate the second parameter with a "
                            "pydantic model (the tool's input)")
        return Tool(id=id or fn.__name__, description=description or inspect.getdoc(fn) or "",
                    input_model=model, execute=fn, needs_approval=needs_approval)

    return make(function) if function is not None else make
