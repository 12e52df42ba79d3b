"""Tether: agents as tools, event-sourced over NATS JetStream with Postgres projections.

The public names below are imported on first use, so `import tether` stays cheap (the
CLI and the services import only what they run).
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # the application side
    "connect": "tether.client",
    "Tether": "tether.client",
    "ParentHandle": "tether.client",
    "AgentTool": "tether.client",
    "agent_tool": "tether.client",
    "message_tool": "tether.client",
    "MessageRefused": "tether.client",
    "RunNotFound": "tether.client",
    "HookRegistry": "tether.client",
    "TimelineView": "tether.client",
    "RunView": "tether.client",
    "TetherError": "tether.client",
    "ServiceUnavailable": "tether.client",
    "InputTooLarge": "tether.client",
    "RequestFailed": "tether.client",
    "ConversationEnded": "tether.client.conversation",
    # the child side
    "ChildAgent": "tether.child.agent",
    "RunContext": "tether.child.context",
    # what runs return and hooks receive
    "AgentToolSuccess": "tether.contract.messages",
    "AgentToolFailure": "tether.contract.messages",
    "DetachedHandle": "tether.contract.messages",
    "RunInfo": "tether.contract.messages",
    "LifecycleResult": "tether.contract.messages",
    "ChatMessage": "tether.contract.messages",
    "RunSnapshot": "tether.contract.messages",
    "Settings": "tether.config",
}

__all__ = [
    "AgentTool", "AgentToolFailure", "AgentToolSuccess", "ChatMessage", "ChildAgent",
    "ConversationEnded", "DetachedHandle", "HookRegistry", "InputTooLarge", "LifecycleResult",
    "MessageRefused", "ParentHandle", "RequestFailed", "RunContext", "RunInfo", "RunNotFound",
    "RunSnapshot",
    "RunView", "ServiceUnavailable", "Settings", "Tether", "TetherError", "TimelineView",
    "agent_tool", "connect", "message_tool",
]

if TYPE_CHECKING:
    from tether.child.agent import ChildAgent
    from tether.child.context import RunContext
    from tether.client import (
        AgentTool,
        HookRegistry,
        InputTooLarge,
        MessageRefused,
        ParentHandle,
        RequestFailed,
        RunNotFound,
        RunView,
        ServiceUnavailable,
        Tether,
        TetherError,
        TimelineView,
        agent_tool,
        connect,
        message_tool,
    )
    from tether.client.conversation import ConversationEnded
    from tether.config import Settings
    from tether.contract.messages import (
        AgentToolFailure,
        AgentToolSuccess,
        ChatMessage,
        DetachedHandle,
        LifecycleResult,
        RunInfo,
        RunSnapshot,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
