"""The agent runtime: definitions, tools, model clients, run and continue, step records.

`Agent` runs a definition in-process; `ModelAgent` makes it a Tether child agent whose
steps are recorded in the run's log (see examples/model_agents.py). Names are imported
on first use, so a command that needs one module (the CLI's `runs show`) stays quick.
"""

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "Agent": "tether.agents.in_process",
    "AgentDefinition": "tether.agents.definition",
    "AgentEvent": "tether.agents.agent_events",
    "AgentRunResult": "tether.agents.results",
    "AgentStepRecord": "tether.agents.steps",
    "AgentStream": "tether.agents.in_process",
    "AgentToolRequest": "tether.agents.model_agent",
    "Decisions": "tether.agents.steps",
    "DynamicContext": "tether.agents.definition",
    "Fail": "tether.agents.clients.scripted",
    "HumanPause": "tether.agents.steps",
    "HumanReview": "tether.agents.definition",
    "Message": "tether.agents.model_messages",
    "ModelAgent": "tether.agents.model_agent",
    "ModelParent": "tether.agents.model_parent",
    "ConversationInput": "tether.agents.model_parent",
    "ModelAgentInput": "tether.agents.model_agent",
    "ModelAgentOverrides": "tether.agents.model_agent",
    "ModelClient": "tether.agents.model_messages",
    "ModelError": "tether.agents.errors",
    "ModelPrice": "tether.agents.usage",
    "ModelRequest": "tether.agents.model_messages",
    "ModelResponse": "tether.agents.model_messages",
    "ModelRetry": "tether.agents.definition",
    "PendingToolCall": "tether.agents.steps",
    "PriceTable": "tether.agents.usage",
    "Reply": "tether.agents.clients.scripted",
    "ReviewRequest": "tether.agents.definition",
    "RunItem": "tether.agents.results",
    "RunRecord": "tether.agents.results",
    "Sampling": "tether.agents.model_messages",
    "ScriptedModelClient": "tether.agents.clients.scripted",
    "StateAccessor": "tether.agents.tools",
    "StepResult": "tether.agents.results",
    "StopCondition": "tether.agents.stop",
    "StopState": "tether.agents.stop",
    "TokenUsage": "tether.agents.model_messages",
    "Tool": "tether.agents.tools",
    "ToolCall": "tether.agents.model_messages",
    "ToolContext": "tether.agents.tools",
    "ToolDecision": "tether.agents.steps",
    "ToolOutput": "tether.agents.steps",
    "ToolRejection": "tether.agents.steps",
    "ToolResult": "tether.agents.steps",
    "ToolSpec": "tether.agents.model_messages",
    "UsageSummary": "tether.agents.usage",
    "cost_exceeds": "tether.agents.stop",
    "is_context_overflow": "tether.agents.errors",
    "is_retryable": "tether.agents.errors",
    "repair_tool_history": "tether.agents.history",
    "retry_after_ms": "tether.agents.errors",
    "step_count_is": "tether.agents.stop",
    "tool": "tether.agents.tools",
    "tool_called": "tether.agents.stop",
    "total_tokens_exceed": "tether.agents.stop",
    "truncate_tool_output": "tether.agents.history",
}

__all__ = [
    "Agent",
    "AgentDefinition",
    "AgentEvent",
    "AgentRunResult",
    "AgentStepRecord",
    "AgentStream",
    "AgentToolRequest",
    "ConversationInput",
    "Decisions",
    "DynamicContext",
    "Fail",
    "HumanPause",
    "HumanReview",
    "Message",
    "ModelAgent",
    "ModelAgentInput",
    "ModelAgentOverrides",
    "ModelClient",
    "ModelError",
    "ModelParent",
    "ModelPrice",
    "ModelRequest",
    "ModelResponse",
    "ModelRetry",
    "PendingToolCall",
    "PriceTable",
    "Reply",
    "ReviewRequest",
    "RunItem",
    "RunRecord",
    "Sampling",
    "ScriptedModelClient",
    "StateAccessor",
    "StepResult",
    "StopCondition",
    "StopState",
    "TokenUsage",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolDecision",
    "ToolOutput",
    "ToolRejection",
    "ToolResult",
    "ToolSpec",
    "UsageSummary",
    "cost_exceeds",
    "is_context_overflow",
    "is_retryable",
    "repair_tool_history",
    "retry_after_ms",
    "step_count_is",
    "tool",
    "tool_called",
    "total_tokens_exceed",
    "truncate_tool_output",
]

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tether.agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
