"""Pydantic AI agents as durable Tether children, and Tether children as their tools.

    Researcher = child(research_agent, description="Looks a question up")   # a child type
    parent_agent = Agent(model, tools=[tether_tool("Researcher", description="...")])

**As a child** (`child(agent, ...)`): a run runs the agent with the run's input as its
prompt. Every model request and every tool call is a step of the run
(`tether.integrations.journal`), through Pydantic AI's own extension point, a capability
(`wrap_model_request`, `wrap_tool_execute`); a runner killed mid-run is replaced by one
that replays the recorded steps, asking the model and calling the tools only for what was
not recorded. The model's token usage is the run's, and rolls up the tree. Text the model
says is the run's output, each tool it calls a progress message. A tool that needs
approval (`requires_approval=True`) or is deferred (`CallDeferred`) pauses the run
`waiting_for_human`, one pending item per call; `continue` answers it (`approvals`,
`rejections`, `tool_outputs` for deferred calls) and the agent goes on from where it
stopped. Cancelling the run cancels the agent's run, and its model request in flight.

**As a parent** (`tether_tool(agent_type, ...)`): a Pydantic AI tool that delegates to a
Tether child. Inside a Tether run it is a nested run of that run; elsewhere it runs under
the `parent` it is given. The model gets the child's summary (and output), or its
structured failure as JSON; the child's usage, and its subtree's, is added to the run's
`RunUsage`, so `UsageLimits` count it; while the child runs, its status, progress and
milestones are `TetherRunEvent`s in the agent's event stream (`run_stream_events`,
`event_stream_handler`). With `detached=True` (or `run_agent_tool`'s detached options,
`{"notify": True}` for a chat message when it ends) it starts the run and returns its
handle at once.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic_core import to_jsonable_python

from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.context import RunCancelled, RunContext, first_of
from tether.domain.ids import framework_run_id
from tether.extras import MissingExtra
from tether.integrations.delegation import (
    ChildCall,
    Prompt,
    answer,
    detached_options,
    prompt_of,
    subtree_usage,
)
from tether.integrations.journal import MISSING, StepJournal

try:
    from pydantic_ai import (
        Agent,
        CustomEvent,
        DeferredToolRequests,
        DeferredToolResults,
        Tool,
        ToolDenied,
    )
    from pydantic_ai import RunContext as AgentRunContext
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import (
        ModelMessagesTypeAdapter,
        ModelResponse,
        TextPart,
        ToolCallPart,
    )
    from pydantic_ai.usage import RunUsage
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("pydantic-ai") from missing

FRAMEWORK = "pydantic_ai"
RESPONSE = TypeAdapter(ModelResponse)


class PydanticAIChild(ChildAgent):
    """A child whose runs run a Pydantic AI agent (`child` makes one)."""

    agent: Any = None  # the Pydantic AI `Agent`

    def prompt(self, input: BaseModel) -> str:
        """The agent's prompt for a run's input (`prompt_of`)."""
        return prompt_of(input)

    async def run(self, ctx: RunContext, input: Any) -> Any:
        journal = StepJournal(ctx, FRAMEWORK)
        options: dict[str, Any] = {"capabilities": [Steps(journal, ctx)],
                                   "output_type": [self.agent.output_type, DeferredToolRequests]}
        if journal.segment == 0:
            options["user_prompt"] = self.prompt(input)
        else:  # answered: go on from the pause, with the answers
            paused, decisions = journal.answered()
            options["message_history"] = ModelMessagesTypeAdapter.validate_python(
                paused["state"])
            options["deferred_tool_results"] = answers(decisions, paused["pending"])
        done, result = await first_of(self.agent.run(**options), ctx)
        if not done:
            raise RunCancelled(f"run {ctx.run_id} was cancelled")
        if isinstance(result.output, DeferredToolRequests):
            return await pause(journal, result)
        return result.output  # text: the summary; else the output


def child(agent: "Agent", *, agent_type: str | None = None, description: str = "",
          input_model: type[BaseModel] = Prompt) -> type[PydanticAIChild]:
    """A child agent type whose runs run `agent`; its name is the agent's unless
    `agent_type` says otherwise."""
    name = agent_type or agent.name
    if not name:
        raise ValueError("child(agent): name the agent (Agent(..., name=...)) or pass "
                         "agent_type")
    return type(name, (PydanticAIChild,), {
        "agent_type": name, "agent": agent, "input_model": input_model,
        "description": description or f"The Pydantic AI agent {name}"})


class Steps(AbstractCapability[Any]):
    """The run's model requests and tool calls as its steps: recorded as they end, given
    back on an attempt that takes the run over."""

    def __init__(self, journal: StepJournal, ctx: RunContext) -> None:
        self.journal, self.ctx = journal, ctx

    async def wrap_model_request(self, ctx: Any, *, request_context: Any, handler: Any) -> Any:
        key = self.journal.next_key("model")
        if (recorded := self.journal.recorded(key)) is not MISSING:
            return RESPONSE.validate_python(recorded["response"])
        await self.ctx.ensure_current()  # a runner paused past its hold calls no model
        response = await handler(request_context)
        usage = response.usage
        await self.journal.record(
            key, "model", {"response": RESPONSE.dump_python(response, mode="json")},
            usage={"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                   "cached_tokens": usage.cache_read_tokens},
            model=response.model_name)
        for part in response.parts:  # what it said and what it calls, as it happens
            if isinstance(part, TextPart) and part.content:
                await self.ctx.output(part.content)
            elif isinstance(part, ToolCallPart):
                await self.ctx.report_progress(message=f"calling {part.tool_name}")
        return response

    async def wrap_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any,
                                handler: Any) -> Any:
        key = self.journal.key("tool", call.tool_call_id)
        if (recorded := self.journal.recorded(key)) is not MISSING:
            ctx.usage.incr(RunUsage(**recorded.get("usage", {})))  # what it added, again
            return recorded["result"]
        await self.ctx.ensure_current()  # a runner paused past its hold runs no tool
        before = (ctx.usage.input_tokens, ctx.usage.output_tokens, ctx.usage.requests)
        result = await handler(args)
        added = {"input_tokens": ctx.usage.input_tokens - before[0],
                 "output_tokens": ctx.usage.output_tokens - before[1],
                 "requests": ctx.usage.requests - before[2]}
        await self.journal.record(key, "tool", {
            "tool": call.tool_name, "result": to_jsonable_python(result),
            "usage": {k: v for k, v in added.items() if v}})
        return result


async def pause(journal: StepJournal, result: Any) -> AwaitingInput:
    """The agent stopped for calls that need a human (approval) or an outside answer:
    the run waits for them, its conversation kept in its log to go on from."""
    requests: DeferredToolRequests = result.output
    pending = ([{"tool_call_id": call.tool_call_id, "tool_name": call.tool_name,
                 "input": call.args_as_dict(), "reason": "approval"}
                for call in requests.approvals]
               + [{"tool_call_id": call.tool_call_id, "tool_name": call.tool_name,
                   "input": call.args_as_dict(), "reason": "external"}
                  for call in requests.calls])
    return await journal.pause(json.loads(result.all_messages_json()), pending)


def answers(decisions: dict[str, Any], pending: list[dict[str, Any]]) -> "DeferredToolResults":
    """The answers of a `continue` as Pydantic AI takes them: an approval runs the call, a
    rejection denies it, a tool output answers a deferred call. A call left unanswered is
    denied, saying so (the agent must go on)."""
    approvals, rejections = set(decisions.get("approvals") or ()), set(
        decisions.get("rejections") or ())
    outputs = decisions.get("tool_outputs") or {}
    results = DeferredToolResults()
    for item in pending:
        call_id = item["tool_call_id"]
        if item["reason"] == "approval":
            results.approvals[call_id] = (True if call_id in approvals else ToolDenied(
                "rejected by a human" if call_id in rejections else "not approved"))
        else:
            results.calls[call_id] = outputs.get(call_id, ToolDenied("no output was given"))
    return results


@dataclass(kw_only=True)
class TetherRunEvent(CustomEvent):
    """A delegated Tether run's status, progress and milestones, at each change, then its
    end (its summary or error), in the calling agent's event stream."""

    run_id: str
    agent_type: str
    status: str
    progress: str | None = None
    milestones: list[str] = field(default_factory=list)
    summary: str | None = None


def tether_tool(agent_type: str, *, description: str, name: str | None = None,
                input_model: type[BaseModel] | None = None, parent: Any = None,
                detached: Any = False, on_finish: str | None = None) -> "Tool[Any]":
    """A Pydantic AI tool that delegates to the Tether child `agent_type` (its input:
    `input_model`'s schema, else any object). Inside a Tether run, the call is a nested
    run; elsewhere it runs under `parent` (a `ParentHandle`: `tether.parent(agent,
    name)`). The child's usage counts against the calling run's usage limits.
    `detached` (True, or `run_agent_tool`'s detached options: `{"notify": True}`,
    `on_finish`, budgets) starts the run and answers with its handle."""
    schema = (input_model.model_json_schema() if input_model is not None
              else {"type": "object", "additionalProperties": True})

    async def delegate(ctx: "AgentRunContext[Any]", **input: Any) -> Any:
        if input_model is not None:
            input = input_model.model_validate(input).model_dump(mode="json")
        call = ChildCall.of(agent_type, input, parent=parent,
                            run_id=framework_run_id("pydantic-ai", ctx.run_id or "",
                                                   ctx.tool_call_id or ""))
        if (options := detached_options(detached, on_finish)) is not None:
            return await call.start_detached(options)
        result = await call.run_telling(lambda event: ctx.emit(TetherRunEvent(**event)))
        if (usage := await subtree_usage(call.owner, result.run_id)) is not None:
            ctx.usage.incr(RunUsage(input_tokens=usage.input_tokens,
                                    output_tokens=usage.output_tokens,
                                    cache_read_tokens=usage.cached_tokens))
        return answer(result)

    return Tool.from_schema(delegate, name=name or agent_type, description=description,
                            json_schema=schema, takes_ctx=True)
