"""The child agents a service knows, by agent type, loaded from their import paths
(`TETHER_AGENTS`, `--agents module:Class`).

Shared by the parent (which validates a request's agent type and input against it) and
the child-runner (which runs them), so neither imports the other.
"""

import hashlib
import importlib
import inspect
import os
from pathlib import Path

from tether.child.agent import AgentConfigurationError, ChildAgent

__all__ = ["AgentConfigurationError", "AgentRegistry", "agent_version", "load_agent"]


_VERSIONS: dict[type[ChildAgent], str] = {}


def agent_version(cls: type[ChildAgent]) -> str:
    """The version of an agent's code: its class's `version` when it sets one (a build
    id, a release), else the first 12 hex digits of the SHA-256 of the source file that
    defines it (the class and the helpers beside it), or of its qualified name when it
    has no file."""
    if cls.version:
        return cls.version
    if (known := _VERSIONS.get(cls)) is not None:
        return known
    try:
        source = Path(inspect.getsourcefile(cls) or "").read_bytes()
    except (OSError, TypeError):
        source = f"{cls.__module__}.{cls.__qualname__}".encode()
    version = _VERSIONS[cls] = hashlib.sha256(source).hexdigest()[:12]
    return version


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

    def version(self, agent_type: str) -> str:
        """The version of a known agent type's code (`agent_version`)."""
        return agent_version(self._by_type[agent_type])

    @property
    def agent_types(self) -> list[str]:
        return sorted(self._by_type)

    @property
    def classes(self) -> list[type[ChildAgent]]:
        return [self._by_type[agent_type] for agent_type in self.agent_types]

    def __bool__(self) -> bool:
        return bool(self._by_type)
