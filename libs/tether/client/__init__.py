"""The application side of Tether: run child agents, follow timelines, handle hooks.

```python
async with connect() as tether:
    me = tether.parent("Assistant", "user-42")
    result = await me.run_agent_tool("Researcher", {"query": "HTTP/3"})
```
"""

from tether.client.awaiting import RunWaiter
from tether.client.child_tool import AgentTool, agent_tool, message_tool
from tether.client.connection import Tether, connect
from tether.client.errors import (
    InputTooLarge,
    MessageRefused,
    NotPermitted,
    RateLimited,
    RequestFailed,
    RunNotFound,
    ServiceUnavailable,
    TetherError,
    UnreadableOutcome,
)
from tether.client.hooks import HookRegistry
from tether.client.parent import ParentHandle
from tether.client.sending import MessageReceipt
from tether.client.timeline import ProgressView, RunView, TimelineView
from tether.domain.ids import tool_run_id

__all__ = [
    "AgentTool",
    "HookRegistry",
    "InputTooLarge",
    "MessageReceipt",
    "MessageRefused",
    "NotPermitted",
    "ParentHandle",
    "ProgressView",
    "RateLimited",
    "RequestFailed",
    "RunNotFound",
    "RunView",
    "RunWaiter",
    "ServiceUnavailable",
    "Tether",
    "TetherError",
    "TimelineView",
    "UnreadableOutcome",
    "agent_tool",
    "connect",
    "message_tool",
    "tool_run_id",
]
