"""What the frameworks' children and their Tether tools share: a run's prompt from its
input, and a call of a Tether child from inside a framework's tool."""

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from tether.child.context import current_context
from tether.contract.messages import UsageView
from tether.domain.detached_options import DetachedOptions


class Prompt(BaseModel):
    """The input of a child made from an agent without an input model: its prompt."""

    prompt: str


def prompt_of(input: BaseModel) -> str:
    """An agent's prompt for a run's input: its one text field, else the input as JSON."""
    data = input.model_dump(mode="json")
    if len(data) == 1 and isinstance(text := next(iter(data.values())), str):
        return text
    return json.dumps(data)


@dataclass(frozen=True)
class ChildCall:
    """Where a framework's tool runs the Tether child `agent_type`: a nested run of the
    Tether run the tool is called in (its id from its input, so a call made again finds
    the same run), else a run of the `parent` the tool was given. `owner` is the parent
    handle the run is under."""

    agent_type: str
    input: dict[str, Any]
    run_id: str
    owner: Any
    ctx: Any  # the Tether run it is nested in, or None

    @classmethod
    def of(cls, agent_type: str, input: dict[str, Any], *, parent: Any,
           run_id: str) -> "ChildCall":
        """`run_id`: the run's id outside a Tether run."""
        ctx = current_context()
        if ctx is not None and ctx.in_run:
            return cls(agent_type, input, ctx.nested_run_id(agent_type, input), ctx.client, ctx)
        if parent is None:
            raise RuntimeError(f"tether_tool({agent_type!r}) is called outside a Tether run: "
                               "give it the parent to run under (parent=tether.parent(agent, "
                               "name))")
        return cls(agent_type, input, run_id, parent, None)

    async def run(self, **options: Any) -> Any:
        runner = self.ctx if self.ctx is not None else self.owner
        return await runner.run_agent_tool(self.agent_type, self.input, run_id=self.run_id,
                                           **options)

    async def start_detached(self, options: Any) -> dict[str, Any]:
        """Start the run and answer with its handle at once; `options`: `run_agent_tool`'s
        `detached` (True, or a finish hook, notifications, budgets)."""
        handle = await self.run(detached=options)
        return {"run_id": handle.run_id, "status": handle.status, "detached": True}

    async def run_telling(self, tell: Callable[[dict[str, Any]], Any] | None,
                          **options: Any) -> Any:
        """`run`, telling `tell` (a function, or a coroutine function) the child's status,
        progress message and milestones at each change, then its end (with its summary
        or its error): the framework's own stream of events."""
        if tell is None:
            return await self.run(**options)
        relay = asyncio.create_task(self._relay(tell))
        try:
            result = await self.run(**options)
        finally:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
        await _told(tell, {"run_id": self.run_id, "agent_type": self.agent_type,
                           "status": "completed" if result.ok else result.status,
                           "summary": result.summary if result.ok else result.error})
        return result

    async def _relay(self, tell: Callable[[dict[str, Any]], Any]) -> None:
        said = None
        async for view in self.owner.timeline(run_id=self.run_id):
            run = view.runs.get(self.run_id)
            if run is None:
                continue
            event = {"run_id": self.run_id, "agent_type": self.agent_type,
                     "status": run.status,
                     "progress": run.progress.message if run.progress else None,
                     "milestones": [milestone.name for milestone in run.milestones]}
            if event != said:
                said = event
                await _told(tell, event)


async def _told(tell: Callable[[dict[str, Any]], Any], event: dict[str, Any]) -> None:
    told = tell(event)
    if inspect.isawaitable(told):
        await told


def detached_options(detached: Any, on_finish: str | None) -> Any:
    """What a framework tool's `detached=` and `on_finish=` ask for: None (the call awaits
    the run), or `run_agent_tool`'s `detached` (with `on_finish` added to it)."""
    if on_finish is None:
        return detached or None
    if isinstance(detached, DetachedOptions):
        return msgspec.structs.replace(detached, on_finish=on_finish)
    return {**(detached if isinstance(detached, Mapping) else {}), "on_finish": on_finish}


async def subtree_usage(owner: Any, run_id: str) -> UsageView | None:
    """The model usage of a finished child run and of every run below it."""
    snapshot = await owner.inspect(run_id)
    return getattr(snapshot, "subtree_usage", None) if snapshot is not None else None


def answer(result: Any) -> dict[str, Any]:
    """What a framework's model gets back: the summary and output, or the structured
    failure."""
    return ({"summary": result.summary, "output": result.output} if result.ok
            else result.model_dump(mode="json"))
