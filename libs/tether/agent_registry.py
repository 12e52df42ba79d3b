"""The child agents a service knows, by agent type, loaded from their import paths
(`TETHER_AGENTS`, `--agents module:Class`).

Shared by the parent (which validates a request's agent type and input against it) and
the child-runner (which runs them), so neither imports the other.
"""

import importlib
import os

from tether.child.agent import AgentConfigurationError, ChildAgent

__all__ = ["AgentConfigurationError", "AgentRegistry", "load_agent"]


def load_agent(path: str) -> type[ChildAgent]:
    """`package.module:ClassName` -> the class, with an error that says what is wrong."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise AgentConfigurationError(
            f"agent {path!r}: expected an import path like package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AgentConfigurationError(
            f"agent {path!r}: cannot import {module_name} (from the current directory "
            f"{os.getcwd()} or the installed packages): {error}") from None
    cls = getattr(module, attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, ChildAgent)):
        raise AgentConfigurationError(
            f"agent {path!r}: {attribute} is not a ChildAgent subclass in {module_name}")
    return cls


class AgentRegistry:
    """The child agents a service knows, by agent type."""

    def __init__(self, classes: "list[type[ChildAgent]] | tuple[type[ChildAgent], ...]" = ()) -> None:
        self._by_type: dict[str, type[ChildAgent]] = {}
        for cls in classes:
            if cls.agent_type in self._by_type and self._by_type[cls.agent_type] is not cls:
                raise AgentConfigurationError(f"two agents are named {cls.agent_type!r}")
            self._by_type[cls.agent_type] = cls

    @classmethod
    def from_paths(cls, paths: "list[str] | tuple[str, ...]") -> "AgentRegistry":
        return cls([load_agent(path) for path in paths])

    def get(self, agent_type: str) -> type[ChildAgent] | None:
        return self._by_type.get(agent_type)

    @property
    def agent_types(self) -> list[str]:
        return sorted(self._by_type)

    def __bool__(self) -> bool:
        return bool(self._by_type)
