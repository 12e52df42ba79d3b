"""OpenAI Agents SDK agents as durable Tether children, and Tether children as their tools.

    Researcher = child(research_agent, description="Looks a question up")   # a child type
    parent_agent = Agent(name="Desk", tools=[tether_tool("Researcher", description="...")])

**As a child** (`child(agent, ...)`): a run runs the agent (`Runner.run`) with the run's
input as its prompt. The agent, and every agent it hands off to, runs with its model
wrapped (the SDK's `Model` interface, as its Temporal integration does) and its function
tools wrapped, so that every model response and every tool result is a step of the run
(`tether.integrations.journal`): a runner killed mid-run is replaced by one that replays
them, asking the model and calling the tools only for what was not recorded. The
model's token usage is the run's, and rolls up the tree; text the model says is the
run's output, each tool it calls a progress message. A tool with `needs_approval` pauses
the run `waiting_for_human` (the SDK's interruptions, its `RunState` kept in the run's
log); `continue` approves or rejects each call and the run goes on from there.
Cancelling the run cancels the agent's run and its model request in flight.

**As a parent** (`tether_tool(agent_type, ...)`): a `FunctionTool` that delegates to a
Tether child: a nested run inside a Tether run, else a run of the `parent` it is given.
The model gets the child's summary and output, or its structured failure; the child's
usage, and its subtree's, is added to the calling run's usage. Its `on_stream` callback
is told the child's events while it runs (`TetherToolStreamEvent`), the SDK's own way
for a nested agent's events (`Agent.as_tool(on_stream=...)`).
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Any, TypedDict

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
    from agents import Agent, FunctionTool, Model, ModelResponse, Runner, RunState, Usage
    from agents.models.multi_provider import MultiProvider
    from agents.tool_context import ToolContext
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("openai-agents") from missing

FRAMEWORK = "openai_agents"
RESPONSE = TypeAdapter(ModelResponse)


class OpenAIAgentsChild(ChildAgent):
    """A child whose runs run an Agents SDK agent (`child` makes one)."""

    agent: Any = None  # the Agents SDK `Agent`

    def prompt(self, input: BaseModel) -> str:
        """The agent's prompt for a run's input (`prompt_of`)."""
        return prompt_of(input)

    async def run(self, ctx: RunContext, input: Any) -> Any:
        journal = StepJournal(ctx, FRAMEWORK)
        agent = recorded_agent(self.agent, journal, ctx)
        start: Any = self.prompt(input)
        if journal.segment > 0:  # answered: go on from the pause, with the answers
            paused, decisions = journal.answered()
            start = await RunState.from_string(agent, paused["state"])
            decide(start, decisions)
        done, result = await first_of(Runner.run(agent, start), ctx)
        if not done:
            raise RunCancelled(f"run {ctx.run_id} was cancelled")
        if result.interruptions:
            return await pause(journal, result)
        output = result.final_output
        return output if isinstance(output, str) else to_jsonable_python(output)


def child(agent: "Agent[Any]", *, agent_type: str | None = None, description: str = "",
          input_model: type[BaseModel] = Prompt) -> type[OpenAIAgentsChild]:
    """A child agent type whose runs run `agent`; its name is the agent's unless
    `agent_type` says otherwise (an agent type is an identifier: no spaces)."""
    name = agent_type or agent.name
    return type(name, (OpenAIAgentsChild,), {
        "agent_type": name, "agent": agent, "input_model": input_model,
        "description": description or agent.handoff_description or f"The agent {name}"})


class RecordedModel(Model):
    """An agent's model whose responses are the run's steps."""

    def __init__(self, wrapped: "Model", journal: StepJournal, ctx: RunContext) -> None:
        self.wrapped, self.journal, self.ctx = wrapped, journal, ctx

    async def get_response(self, *args: Any, **kwargs: Any) -> "ModelResponse":
        key = self.journal.next_key("model")
        if (recorded := self.journal.recorded(key)) is not MISSING:
            return RESPONSE.validate_python(recorded["response"])
        await self.ctx.ensure_current()  # a runner paused past its hold calls no model
        response = await self.wrapped.get_response(*args, **kwargs)
        usage = response.usage
        await self.journal.record(
            key, "model", {"response": RESPONSE.dump_python(
                response, mode="json", by_alias=True)},
            usage={"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                   "cached_tokens": usage.input_tokens_details.cached_tokens or 0})
        for item in response.output:  # what it said and what it calls, as it happens
            if isinstance(item, ResponseOutputMessage):
                text = "".join(getattr(part, "text", "") for part in item.content)
                if text:
                    await self.ctx.output(text)
            elif isinstance(item, ResponseFunctionToolCall):
                await self.ctx.report_progress(message=f"calling {item.name}")
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a Tether child runs its agent with Runner.run: its model "
                                  "is asked for whole responses")


def recorded_agent(agent: "Agent[Any]", journal: StepJournal, ctx: RunContext,
                   seen: dict[int, "Agent[Any]"] | None = None) -> "Agent[Any]":
    """A copy of `agent` (and of the agents it hands off to) whose model responses and
    function tool results are the run's steps."""
    seen = {} if seen is None else seen
    if id(agent) in seen:
        return seen[id(agent)]
    model = agent.model if isinstance(agent.model, Model) else MultiProvider().get_model(
        agent.model)
    copy = agent.clone(model=RecordedModel(model, journal, ctx))
    seen[id(agent)] = copy
    copy.tools = [recorded_tool(tool, journal) if isinstance(tool, FunctionTool) else tool
                  for tool in agent.tools]
    copy.handoffs = [recorded_agent(handoff, journal, ctx, seen)
                     if isinstance(handoff, Agent) else handoff for handoff in agent.handoffs]
    return copy


def recorded_tool(tool: "FunctionTool", journal: StepJournal) -> "FunctionTool":
    invoke = tool.on_invoke_tool

    async def recorded(context: "ToolContext[Any]", arguments: str) -> Any:
        key = journal.key("tool", context.tool_call_id)
        if (step := journal.recorded(key)) is not MISSING:
            if step.get("usage"):
                context.usage.add(Usage(**step["usage"]))  # what it added, again
            return step["result"]
        await journal.ctx.ensure_current()  # a runner paused past its hold runs no tool
        before = (context.usage.requests, context.usage.input_tokens,
                  context.usage.output_tokens)
        result = await invoke(context, arguments)
        added = {"requests": context.usage.requests - before[0],
                 "input_tokens": context.usage.input_tokens - before[1],
                 "output_tokens": context.usage.output_tokens - before[2]}
        if any(added.values()):
            added["total_tokens"] = added["input_tokens"] + added["output_tokens"]
        await journal.record(key, "tool", {"tool": tool.name,
                                           "result": to_jsonable_python(result),
                                           "usage": added if any(added.values()) else {}})
        return result

    return dataclasses.replace(tool, on_invoke_tool=recorded)


async def pause(journal: StepJournal, result: Any) -> AwaitingInput:
    """Tool calls wait for approval: the run waits for a human, the SDK's state kept in
    its log to go on from."""
    pending = [{"tool_call_id": _call_id(item), "tool_name": item.tool_name,
                "input": json.loads(item.arguments or "{}"), "reason": "approval"}
               for item in result.interruptions]
    return await journal.pause(result.to_state().to_string(), pending)


def decide(state: "RunState[Any]", decisions: dict[str, Any]) -> None:
    """The answers of a `continue` on the SDK's state: approve what was approved, reject
    the rest (saying whether a human rejected it)."""
    approvals = set(decisions.get("approvals") or ())
    rejections = set(decisions.get("rejections") or ())
    for item in state.get_interruptions():
        call_id = _call_id(item)
        if call_id in approvals:
            state.approve(item)
        else:
            state.reject(item, rejection_message=("rejected by a human" if call_id in rejections
                                                  else "not approved"))


def _call_id(item: Any) -> str:
    """The call id of an interruption's tool call (an object, or its dict)."""
    raw = item.raw_item
    return raw.get("call_id", "") if isinstance(raw, dict) else getattr(raw, "call_id", "")


class TetherToolStreamEvent(TypedDict):
    """What `tether_tool(on_stream=...)` is told while its Tether child runs: as the
    SDK's `Agent.as_tool(on_stream=...)` tells the events of a nested agent run."""

    event: dict[str, Any]
    """The child's status, progress message and milestones at a change; at its end, its
    summary or its error."""

    agent_type: str
    """The Tether child's agent type."""

    tool_call: "ResponseFunctionToolCall | None"
    """The originating tool call, if available."""


def tether_tool(agent_type: str, *, description: str, name: str | None = None,
                input_model: type[BaseModel] | None = None, parent: Any = None,
                detached: Any = False, on_finish: str | None = None,
                on_stream: Callable[[TetherToolStreamEvent], Any] | None = None
                ) -> "FunctionTool":
    """A function tool that delegates to the Tether child `agent_type` (its input:
    `input_model`'s schema, else any object). Inside a Tether run, the call is a nested
    run; elsewhere it runs under `parent` (`tether.parent(agent, name)`), its id the tool
    call's. `detached` (True, or `run_agent_tool`'s detached options:
    `{"notify": True}`, `on_finish`, budgets) starts the run and answers with its handle. `on_stream` (a function or a coroutine function) is told the child's events
    while it runs, as the SDK's `as_tool(on_stream=...)` is a nested agent's."""
    schema = (input_model.model_json_schema() if input_model is not None
              else {"type": "object", "additionalProperties": True})

    async def delegate(context: "ToolContext[Any]", arguments: str) -> str:
        input = json.loads(arguments or "{}")
        if input_model is not None:
            input = input_model.model_validate(input).model_dump(mode="json")
        call = ChildCall.of(agent_type, input, parent=parent,
                            run_id=framework_run_id("openai-agents", context.tool_call_id))
        if (options := detached_options(detached, on_finish)) is not None:
            return json.dumps(await call.start_detached(options))
        tell = None if on_stream is None else lambda event: on_stream(TetherToolStreamEvent(
            event=event, agent_type=agent_type, tool_call=context.tool_call))
        result = await call.run_telling(tell)
        if (usage := await subtree_usage(call.owner, result.run_id)) is not None:
            context.usage.add(Usage(requests=0, input_tokens=usage.input_tokens,
                                    output_tokens=usage.output_tokens,
                                    total_tokens=usage.total_tokens))
        return json.dumps(answer(result))

    return FunctionTool(name=name or agent_type, description=description,
                        params_json_schema=schema, on_invoke_tool=delegate,
                        strict_json_schema=False)
