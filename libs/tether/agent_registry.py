"""The child agents a service knows, by agent type.

Shared by the parent (which validates a request's agent type and input against it) and
the child-runner (which runs them), so neither imports the other. A registry holds agent
classes as the parent sees them (`AgentClass`); `tether.child.loading` loads
`ChildAgent` classes from their import paths (`TETHER_AGENTS`, `--agents module:Class`)
into one.
"""

import hashlib
import inspect
from pathlib import Path
from typing import ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel

__all__ = ["AgentClass", "AgentConfigurationError", "AgentRegistry", "agent_version"]


class AgentConfigurationError(ValueError):
    """An agent class, or the setting that names it, is wrong; the message says how."""


class AgentClass(Protocol):
    """What the parent and the runner's bookkeeping read off an agent class
    (`tether.child.agent.ChildAgent` has all of it)."""

    agent_type: ClassVar[str]
    input_model: ClassVar[type[BaseModel]]
    max_concurrent_agent_tools: ClassVar[int | None]
    version: ClassVar[str]


A = TypeVar("A", bound=AgentClass)

_VERSIONS: dict[type[AgentClass], str] = {}


def agent_version(cls: type[AgentClass]) -> str:
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


class AgentRegistry(Generic[A]):
    """The child agents a service knows, by agent type."""

    def __init__(self, classes: "list[type[A]] | tuple[type[A], ...]" = ()) -> None:
        self._by_type: dict[str, type[A]] = {}
        for cls in classes:
            if cls.agent_type in self._by_type and self._by_type[cls.agent_type] is not cls:
                raise AgentConfigurationError(f"two agents are named {cls.agent_type!r}")
            self._by_type[cls.agent_type] = cls

    def get(self, agent_type: str) -> type[A] | None:
        return self._by_type.get(agent_type)

    def version(self, agent_type: str) -> str:
        """The version of a known agent type's code (`agent_version`)."""
        return agent_version(self._by_type[agent_type])

    @property
    def agent_types(self) -> list[str]:
        return sorted(self._by_type)

    @property
    def classes(self) -> list[type[A]]:
        return [self._by_type[agent_type] for agent_type in self.agent_types]

    def __bool__(self) -> bool:
        return bool(self._by_type)
