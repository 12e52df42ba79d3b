"""Compiled LangGraph graphs as durable Tether children, and Tether children as their tools.

    Researcher = child(graph, agent_type="Researcher", description="Looks a question up")
    tools = [tether_tool("Researcher", description="...")]      # for a ToolNode, an agent

**As a child** (`child(graph, ...)`): a run runs the graph with a checkpointer that writes
to the run's log (`RunLog`, each checkpoint and each task's writes a step of the run,
with durability `sync`: a step is in the log before the next one starts). A runner killed
mid-run is replaced by one that rebuilds the checkpoints from the log and goes on from the
last one: no node that finished runs again. The token usage of every chat model call
(`usage_metadata`) is the run's, and rolls up the tree; each node that finishes is a
progress message, and the text of each AI message the run's output. An `interrupt()`
pauses the run `waiting_for_human` (one pending item per interrupt, its value as the
input); `continue` resumes it with `Command(resume=...)`: the human input, or the tool
output given for the item. Cancelling the run cancels the graph's run.

The run's input is the graph's input: `{"messages": [user prompt]}` for the default
input model (`Prompt`), else the input model's fields. The run's summary is the text of
the last message when the final state has `messages`; its output the final state.

**As a parent** (`tether_tool(agent_type, ...)`): a LangChain tool (for a `ToolNode`, or
`langchain.agents.create_agent`) that delegates to a Tether child, a nested run inside a
Tether run, else a run of the `parent` it is given; it answers with the child's summary
and output, or its structured failure, as JSON. While the child runs, its progress goes
to the graph's custom stream (`stream_mode="custom"`) as `{"tether": {...}}` events
(its status, progress message and milestones, at each change; then its end, with its
summary or its error).
"""

import base64
import copy
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, create_model
from pydantic_core import to_jsonable_python

from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.context import RunCancelled, RunContext, first_of
from tether.domain.ids import framework_run_id
from tether.extras import MissingExtra
from tether.integrations.delegation import ChildCall, Prompt, answer, detached_options
from tether.integrations.journal import StepJournal

try:
    from langchain_core.callbacks import AsyncCallbackHandler
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import InjectedToolCallId, StructuredTool
    from langgraph.checkpoint.base import (
        WRITES_IDX_MAP,
        BaseCheckpointSaver,
        CheckpointTuple,
        get_checkpoint_id,
        get_checkpoint_metadata,
    )
    from langgraph.config import get_stream_writer
    from langgraph.types import Command
except ImportError as missing:  # pragma: no cover - the extra is installed in the tests
    raise MissingExtra("langgraph") from missing

FRAMEWORK = "langgraph"


class LangGraphChild(ChildAgent):
    """A child whose runs run a compiled LangGraph graph (`child` makes one)."""

    graph: Any = None  # the compiled graph (a `Pregel`)

    def graph_input(self, input: BaseModel) -> dict[str, Any]:
        """The graph's input for a run's input: a user message of the prompt, or the
        input model's fields."""
        if isinstance(input, Prompt):
            return {"messages": [{"role": "user", "content": input.prompt}]}
        return input.model_dump(mode="json")

    async def run(self, ctx: RunContext, input: Any) -> Any:
        journal = StepJournal(ctx, FRAMEWORK)
        saver = RunLog(journal)
        graph = self.graph.copy(update={"checkpointer": saver})
        config = {"configurable": {"thread_id": ctx.run_id},
                  "callbacks": [ModelUsage(journal)]}
        state = await graph.aget_state(config)
        if state.interrupts and journal.segment > 0 and ctx.history is not None:
            start: Any = Command(resume=_resume_value(state.interrupts,
                                                      ctx.history.resumptions[-1].decisions))
        elif state.next or state.interrupts:
            start = None  # taken over mid-run: go on from the last checkpoint
        elif state.values:
            return self._result(state.values)  # it had finished
        else:
            start = self.graph_input(input)
        done, interrupts = await first_of(self._run(graph, start, config, ctx), ctx)
        if not done:
            raise RunCancelled(f"run {ctx.run_id} was cancelled")
        if interrupts:
            return AwaitingInput(
                reason="waiting_for_human", key=f"langgraph-{journal.segment}",
                pending=[{"tool_call_id": item.id, "tool_name": self.agent_type,
                          "input": to_jsonable_python(item.value), "reason": "input"}
                         for item in interrupts])
        return self._result((await graph.aget_state(config)).values)

    def _result(self, values: dict[str, Any]) -> Any:
        """The final state as the run's output; the last message's text its summary."""
        messages = values.get("messages") if isinstance(values, dict) else None
        last = getattr(messages[-1], "content", None) if messages else None
        self._summary = last if isinstance(last, str) else None
        return to_jsonable_python(values, fallback=str)

    async def get_summary(self, run_id: str, output: Any) -> str | None:
        return getattr(self, "_summary", None)

    async def _run(self, graph: Any, start: Any, config: dict, ctx: RunContext) -> list:
        """Run the graph to its end or its interrupts, saying each node that finishes."""
        interrupts: list = []
        async for update in graph.astream(start, config, stream_mode="updates",
                                          durability="sync"):
            for node, values in (update or {}).items():
                if node == "__interrupt__":
                    interrupts.extend(values)
                    continue
                await ctx.report_progress(message=f"{node} finished")
                for message in (values or {}).get("messages", []) if isinstance(
                        values, dict) else []:
                    if getattr(message, "type", "") == "ai" and isinstance(
                            message.content, str) and message.content:
                        await ctx.output(message.content)
        return interrupts


def child(graph: Any, *, agent_type: str, description: str = "",
          input_model: type[BaseModel] = Prompt) -> type[LangGraphChild]:
    """A child agent type whose runs run the compiled `graph`."""
    return type(agent_type, (LangGraphChild,), {
        "agent_type": agent_type, "graph": graph, "input_model": input_model,
        "description": description or f"The LangGraph graph {agent_type}"})


def _resume_value(interrupts: Sequence[Any], decisions: dict[str, Any]) -> Any:
    """What `Command(resume=...)` carries for a `continue`: per interrupt, the tool output
    given for its item, else the human input."""
    outputs = decisions.get("tool_outputs") or {}
    text = decisions.get("human_input")
    values = {item.id: outputs.get(item.id, text) for item in interrupts}
    return next(iter(values.values())) if len(values) == 1 else values


class ModelUsage(AsyncCallbackHandler):
    """Each chat model call's token usage, as a step of the run."""

    def __init__(self, journal: StepJournal) -> None:
        self.journal = journal

    async def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        for generations in response.generations:
            for generation in generations:
                usage = getattr(getattr(generation, "message", None), "usage_metadata", None)
                if usage:
                    details = usage.get("input_token_details") or {}
                    await self.journal.append("model", {}, usage={
                        "input_tokens": usage.get("input_tokens", 0),
                        "output_tokens": usage.get("output_tokens", 0),
                        "cached_tokens": details.get("cache_read", 0)})


class RunLog(BaseCheckpointSaver[int]):
    """A checkpointer whose checkpoints and writes are steps of the run: read back from
    its recorded steps when an attempt starts, appended as the graph goes."""

    def __init__(self, journal: StepJournal) -> None:
        super().__init__()
        self.journal = journal
        self._checkpoints: dict[tuple[str, str], dict[str, dict]] = {}
        self._blobs: dict[tuple[str, str, str, Any], list] = {}
        self._writes: dict[tuple[str, str, str], dict[tuple[str, int], dict]] = {}
        for step in journal.of_kind("checkpoint", "writes"):
            self._apply(step)

    def _apply(self, step: dict[str, Any]) -> None:
        if step["kind"] == "checkpoint":
            self._checkpoints.setdefault((step["thread"], step["ns"]), {})[
                step["checkpoint"]["id"]] = step
            for channel, version, value in step["blobs"]:
                self._blobs[(step["thread"], step["ns"], channel, version)] = value
        else:
            bucket = self._writes.setdefault(
                (step["thread"], step["ns"], step["checkpoint_id"]), {})
            for write in step["writes"]:
                inner = (step["task_id"], write["idx"])
                if write["idx"] >= 0 and inner in bucket:
                    continue  # a task's writes are kept once
                bucket[inner] = {**write, "task_id": step["task_id"],
                                 "task_path": step["task_path"]}

    def _encode(self, value: Any) -> list[str]:
        kind, data = self.serde.dumps_typed(value)
        return [kind, base64.b64encode(data).decode()]

    def _decode(self, encoded: list[str]) -> Any:
        return self.serde.loads_typed((encoded[0], base64.b64decode(encoded[1])))

    def _tuple(self, thread: str, ns: str, step: dict[str, Any]) -> CheckpointTuple:
        checkpoint = copy.deepcopy(step["checkpoint"])  # the graph changes what it is given
        checkpoint["channel_values"] = {
            channel: self._decode(encoded)
            for channel, version in checkpoint["channel_versions"].items()
            if (encoded := self._blobs.get((thread, ns, channel, version))) is not None
            and encoded[0] != "empty"}
        bucket = self._writes.get((thread, ns, checkpoint["id"]), {})
        ordered = sorted(bucket.items(), key=lambda kv: (kv[1]["task_path"], kv[0][0], kv[0][1]))
        config: Any = {"configurable": {"thread_id": thread, "checkpoint_ns": ns,
                                        "checkpoint_id": checkpoint["id"]}}
        parent: Any = ({"configurable": {"thread_id": thread, "checkpoint_ns": ns,
                                         "checkpoint_id": step["parent_id"]}}
                       if step["parent_id"] else None)
        return CheckpointTuple(config=config, checkpoint=checkpoint,
                               metadata=self._decode(step["metadata"]), parent_config=parent,
                               pending_writes=[(w["task_id"], w["channel"],
                                                self._decode(w["value"])) for _, w in ordered])

    async def aget_tuple(self, config: Any) -> CheckpointTuple | None:
        configurable = config["configurable"]
        thread, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        by_id = self._checkpoints.get((thread, ns), {})
        if not by_id:
            return None
        step = by_id.get(get_checkpoint_id(config) or max(by_id))  # uuid6 ids sort in time
        return self._tuple(thread, ns, step) if step else None

    async def alist(self, config: Any, *, filter: dict[str, Any] | None = None,
                    before: Any = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        configurable = (config or {}).get("configurable", {})
        wanted = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        for (thread, ns), by_id in list(self._checkpoints.items()):
            if "thread_id" in configurable and thread != configurable["thread_id"]:
                continue
            if configurable.get("checkpoint_ns") not in (None, ns):
                continue
            for checkpoint_id in sorted(by_id, reverse=True):
                if (wanted and checkpoint_id != wanted) or (
                        before_id and checkpoint_id >= before_id):
                    continue
                found = self._tuple(thread, ns, by_id[checkpoint_id])
                if filter and any(found.metadata.get(k) != v for k, v in filter.items()):
                    continue
                if limit is not None:
                    if limit <= 0:
                        return
                    limit -= 1
                yield found

    async def aput(self, config: Any, checkpoint: Any, metadata: Any,
                   new_versions: Any) -> Any:
        configurable = config["configurable"]
        thread, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        saved = dict(checkpoint)
        values = saved.pop("channel_values")
        step = {"kind": "checkpoint", "thread": thread, "ns": ns,
                "parent_id": configurable.get("checkpoint_id"),
                "checkpoint": json.loads(json.dumps(saved)),
                "metadata": self._encode(get_checkpoint_metadata(config, metadata)),
                "blobs": [[channel, version, self._encode(values[channel])
                           if channel in values else ["empty", ""]]
                          for channel, version in new_versions.items()]}
        await self.journal.append("checkpoint", step)
        self._apply(step)
        return {"configurable": {"thread_id": thread, "checkpoint_ns": ns,
                                 "checkpoint_id": checkpoint["id"]}}

    async def aput_writes(self, config: Any, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        configurable = config["configurable"]
        step = {"kind": "writes", "thread": configurable["thread_id"],
                "ns": configurable.get("checkpoint_ns", ""),
                "checkpoint_id": configurable["checkpoint_id"], "task_id": task_id,
                "task_path": task_path,
                "writes": [{"channel": channel, "idx": WRITES_IDX_MAP.get(channel, index),
                            "value": self._encode(value)}
                           for index, (channel, value) in enumerate(writes)]}
        await self.journal.append("writes", step)
        self._apply(step)

    def get_next_version(self, current: int | None, channel: Any = None) -> int:
        return 1 if current is None else int(current) + 1


def tether_tool(agent_type: str, *, description: str, name: str | None = None,
                input_model: type[BaseModel] | None = None, parent: Any = None,
                detached: Any = False, on_finish: str | None = None) -> "StructuredTool":
    """A LangChain tool that delegates to the Tether child `agent_type` (its input:
    `input_model`, else a `prompt`). `detached` (True, or `run_agent_tool`'s detached options:
    `{"notify": True}`, `on_finish`, budgets) starts the run and answers with its handle. It is called with a model's tool call (a `ToolNode`
    does so): outside a Tether run, the run's id is the graph's thread and the tool call's
    id, so a graph resumed from its checkpoint finds the run it had started."""
    fields = input_model or create_model(f"{agent_type}Input", prompt=(str, ...))
    schema = create_model(f"{fields.__name__}Call", __base__=fields,
                          tool_call_id=(Annotated[str, InjectedToolCallId], ...))

    async def delegate(config: RunnableConfig, tool_call_id: str, **input: Any) -> str:
        input = fields.model_validate(input).model_dump(mode="json")
        thread = (config.get("configurable") or {}).get("thread_id") or uuid.uuid4().hex
        call = ChildCall.of(agent_type, input, parent=parent,
                            run_id=framework_run_id(FRAMEWORK, str(thread), tool_call_id))
        if (options := detached_options(detached, on_finish)) is not None:
            return json.dumps(await call.start_detached(options))
        write = _stream_writer()
        result = await call.run_telling(
            None if write is None else lambda event: write({"tether": event}))
        return json.dumps(answer(result))

    return StructuredTool.from_function(coroutine=delegate, name=name or agent_type,
                                        description=description, args_schema=schema)


def _stream_writer() -> Any:
    """The graph's custom stream, or None outside a graph's run."""
    try:
        return get_stream_writer()
    except RuntimeError:
        return None
