"""A framework agent's steps in its run's log: each model call and each tool call, recorded
as it ends (`RunContext.record_step`) and, on the attempt that takes the run over, given
back instead of made again.

A step is found again by its key, not by its place: a model call by its rank in its
segment (`<segment>:model:<n>`: a framework asks its model one call after another), a
tool call by the id the model gave it (`<segment>:tool:<id>`, the same on replay, since
the model's answer is replayed), so tools that run at once are recorded in whatever
order they end. A segment is a stretch of the run between pauses: the calls after the
n-th answer to a pause are segment n. A step's `turn.usage` is counted as the run's model
usage (`UsageView.of_steps`), up the tree.
"""

from typing import Any

from tether.child.agent import AwaitingInput
from tether.child.context import RunContext

MISSING = object()


class StepJournal:
    """The recorded steps of one framework's calls in one run, and the next ones."""

    def __init__(self, ctx: RunContext, framework: str) -> None:
        self.ctx, self.framework = ctx, framework
        history = ctx.history
        steps = history.steps if history is not None else {}
        self.segment = len(history.resumptions) if history is not None else 0
        self._indexed = {index: step for index, step in steps.items()
                         if step.get("framework") == framework and "key" in step}
        self._recorded = {step["key"]: step for step in self._indexed.values()}
        self._next_index = max(steps, default=-1) + 1
        self._ranks: dict[str, int] = {}
        self.replayed = 0  # steps given back instead of made again, in this attempt

    def next_key(self, kind: str) -> str:
        """The key of this segment's next call of `kind` (calls one after another)."""
        rank = self._ranks.get(kind, 0)
        self._ranks[kind] = rank + 1
        return self.key(kind, str(rank))

    def key(self, kind: str, name: str, segment: int | None = None) -> str:
        return f"{self.segment if segment is None else segment}:{kind}:{name}"

    def recorded(self, key: str) -> Any:
        """The step recorded under `key`, or MISSING."""
        step = self._recorded.get(key)
        if step is None:
            return MISSING
        self.replayed += 1
        return step

    async def pause(self, state: Any, pending: list[dict[str, Any]]) -> AwaitingInput:
        """Pause the run for `pending` (`waiting_for_human`), the framework's `state` at
        the pause kept in the log for the answered run to go on from."""
        key = self.key("pause", "state")
        if self.recorded(key) is MISSING:
            await self.record(key, "pause", {"state": state, "pending": pending})
        return AwaitingInput(reason="waiting_for_human", key=f"{self.framework}-{self.segment}",
                             pending=pending)

    def answered(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """For a run answered after a pause (segment > 0): the pause as `pause` recorded
        it, and the answers of the `continue`."""
        paused = self.recorded(self.key("pause", "state", self.segment - 1))
        history = self.ctx.history
        if paused is MISSING or history is None or not history.resumptions:
            raise RuntimeError(f"run {self.ctx.run_id} was answered, but its pause is not in "
                               "its log")
        return paused, history.resumptions[-1].decisions

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        """The recorded steps of these kinds, in the order they were recorded."""
        return [step for _, step in sorted(self._indexed.items())
                if step.get("kind") in kinds]

    async def append(self, kind: str, step: dict[str, Any], *,
                     usage: dict[str, int] | None = None) -> None:
        """Record a step that is read back whole, not found by key (a checkpoint)."""
        await self.record(f"{kind}:{self._next_index}", kind, step, usage=usage)

    async def record(self, key: str, kind: str, step: dict[str, Any], *,
                     usage: dict[str, int] | None = None, model: str | None = None) -> None:
        """Record a finished call before the agent goes on; its usage, when a model's."""
        index = self._next_index
        self._next_index += 1  # taken at once: calls that end together get their own
        recorded = {"kind": kind, "framework": self.framework, "key": key, **step}
        if usage is not None:
            recorded["turn"] = {"usage": usage}
            recorded["cost"] = None  # unknown: no price table for the framework's models
        if model is not None:
            recorded["model"] = model
        await self.ctx.record_step(index, recorded)
        self._recorded[key] = recorded
        self._indexed[index] = recorded
