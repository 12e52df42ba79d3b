"""The texts of chat notifications, overridable per deployment (`TETHER_FORMATTERS`).

An override is an object (or a class, instantiated without arguments) named by import
path, with either method below; an empty string suppresses that message.
"""

import importlib
from typing import Any, Protocol

from tether.contract.messages import LifecycleResult, MilestoneView, RunInfo


class Formatters(Protocol):
    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str: ...

    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str: ...


class DefaultFormatters:
    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str:
        head = f"Background task {run.agent_type} ({run.run_id})"
        if result.status == "completed":
            return f"{head} completed: {result.summary or '(no summary)'}"
        if result.status == "interrupted":
            still = " The child is still running." if result.child_still_running else ""
            return f"{head} was interrupted ({result.reason}): {result.error}.{still}"
        return f"{head} ended {result.status}: {result.error}"

    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str:
        return f"{run.agent_type} ({run.run_id}) reached {milestone.name}."


class _Layered:
    """The override's methods where it has them, the defaults elsewhere."""

    def __init__(self, override: Any) -> None:
        self._override, self._default = override, DefaultFormatters()

    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str:
        method = getattr(self._override, "format_detached_completion", None)
        return (method or self._default.format_detached_completion)(run, result)

    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str:
        method = getattr(self._override, "format_detached_milestone", None)
        return (method or self._default.format_detached_milestone)(run, milestone)


def default_format(method: Any) -> Any:
    """Marks a class's formatter method as the default one: the deployment's formatters
    (`TETHER_FORMATTERS`) word the message instead."""
    method.default_format = True
    return method


class ByParentClass:
    """A parent that is a registered agent class with its own formatter methods (a model
    parent that overrides them) words its runs' messages itself; every other parent gets
    `fallback`."""

    def __init__(self, agents: Any, fallback: Formatters) -> None:
        self._agents, self._fallback = agents, fallback
        self._instances: dict[str, Any] = {}

    def _for(self, run: RunInfo, method: str) -> Any:
        cls = self._agents.get(run.parent.agent) if self._agents else None
        found = getattr(cls, method, None) if cls is not None else None
        if cls is None or not callable(found) or getattr(found, "default_format", False):
            return getattr(self._fallback, method)
        if cls.agent_type not in self._instances:
            self._instances[cls.agent_type] = cls()
        return getattr(self._instances[cls.agent_type], method)

    def format_detached_completion(self, run: RunInfo, result: LifecycleResult) -> str:
        return self._for(run, "format_detached_completion")(run, result)

    def format_detached_milestone(self, run: RunInfo, milestone: MilestoneView) -> str:
        return self._for(run, "format_detached_milestone")(run, milestone)


def load_formatters(path: str | None) -> Formatters:
    if not path:
        return DefaultFormatters()
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"TETHER_FORMATTERS={path!r}: expected module:attribute")
    target = getattr(importlib.import_module(module_name), attribute, None)
    if target is None:
        raise ValueError(f"TETHER_FORMATTERS={path!r}: {module_name} has no {attribute}")
    return _Layered(target() if isinstance(target, type) else target)


def parent_formatters(formatters_path: str | None, parents: Any) -> ByParentClass:
    """The services' formatters: the parent classes `parents` (an agent registry: the
    services' `TETHER_AGENTS`) word their own runs' messages where they override a
    method, `TETHER_FORMATTERS` (`formatters_path`) or the defaults every other's."""
    return ByParentClass(parents, load_formatters(formatters_path))
