"""Child agent classes loaded from their import paths (`TETHER_AGENTS`, `--agents
module:Class`), with an error that says what is wrong."""

import importlib
import os

from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.child.agent import ChildAgent


def load_agent(path: str) -> type[ChildAgent]:
    """`package.module:ClassName` -> the class."""
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


def load_agents(paths: "list[str] | tuple[str, ...]") -> AgentRegistry[ChildAgent]:
    """The registry of the agents at `paths`."""
    return AgentRegistry([load_agent(path) for path in paths])
