"""What a model reads and writes: messages, tool calls, tool specs, requests and responses.

These are the model-client protocol's vocabulary (ModelRequest / ModelResponse,
Message, ToolCall, ToolSpec). They are frozen pydantic models so a step record that holds
them can be stored as JSON in the run's log and read back unchanged.
"""

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant", "tool"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCall(Frozen):
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    # Set when the model's arguments were not a JSON object: the call is answered with an
    # error the model can correct, instead of failing the run.
    arguments_error: str | None = None


def unique_call_ids(calls: "tuple[ToolCall, ...]", taken: "set[str]",
                    step: int) -> "tuple[ToolCall, ...]":
    """The calls of one model turn with ids that name one call each in the run.

    A provider's id is kept when it is one: present, not used by an earlier turn of the
    run (`taken`), not repeated in this turn. Otherwise (a provider that sends none, or
    numbers its calls per turn, `call_0` again and again) the call is named by the turn's
    step and its position in it, `tether_<step>_<n>`. The turn is recorded with these
    ids, so a resumed run reads the same ones and no call runs twice; and an agent tool's
    run id derives from its call's id (`tool_run_id`), so each call is its own run.
    """
    seen = set(taken)
    unique: list[ToolCall] = []
    for position, call in enumerate(calls):
        call_id = call.id.strip()
        if not call_id or call_id in seen:
            call_id = f"tether_{step}_{position}"
            suffix = 0
            while call_id in seen:
                suffix += 1
                call_id = f"tether_{step}_{position}_{suffix}"
        seen.add(call_id)
        unique.append(call if call_id == call.id else call.model_copy(update={"id": call_id}))
    return tuple(unique)


class Message(Frozen):
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False
    reasoning: str | None = None

    @classmethod
    def user(cls, content: str) -> "Message":
        return cls(role="user", content=content)

    @classmethod
    def assistant(cls, content: str, tool_calls: "tuple[ToolCall, ...] | list[ToolCall]" = ()
                  ) -> "Message":
        return cls(role="assistant", content=content, tool_calls=tuple(tool_calls))

    @classmethod
    def tool(cls, tool_call_id: str, name: str, content: str, is_error: bool = False) -> "Message":
        return cls(role="tool", content=content, tool_call_id=tool_call_id, name=name,
                   is_error=is_error)


class ToolSpec(Frozen):
    """What the model is told about a tool: `parameters` is the input's JSON Schema."""

    id: str
    description: str
    parameters: dict[str, Any]


class Sampling(Frozen):
    """Sampling settings sent with each model request; None leaves the provider's default."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, gt=0)
    stop: tuple[str, ...] = ()
    seed: int | None = None


class TokenUsage(Frozen):
    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)  # the part of input_tokens served from cache
    total_tokens: int = Field(default=0, ge=0)  # input + output unless the provider says

    @model_validator(mode="before")
    @classmethod
    def _total(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("total_tokens"):
            data = {**data, "total_tokens": (data.get("input_tokens") or 0)
                    + (data.get("output_tokens") or 0)}
        return data


class ModelRequest(Frozen):
    agent_id: str
    model: str  # the effective model: run option, else the definition's
    instructions: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    sampling: Sampling = Sampling()
    preset: str | None = None
    context: Any = None  # the application's context, as given to run()
    run_id: str | None = None


class ModelResponse(Frozen):
    message: Message
    usage: TokenUsage = TokenUsage()
    request_id: str | None = None
    provider: str | None = None
    model: str | None = None
    finish_reason: str | None = None


TextDelta = Callable[[str], Awaitable[None]]


class ModelClient(Protocol):
    """Sends one model turn. Implement it to reach a model over another transport.

    A streaming client calls `on_delta` with each piece of the answer's text as it
    arrives; a client that does not stream may ignore it (the text is then emitted
    whole when the response arrives). Failures are raised, preferably as
    `tether.agents.errors.ModelError`, so the runtime can tell which are retryable.
    """

    async def complete(self, request: ModelRequest,
                       on_delta: TextDelta | None = None) -> ModelResponse: ...
