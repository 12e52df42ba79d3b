"""AgentTool: the definition a parent model sees, and what execute() sends and returns."""

from typing import Any

import pytest
from pydantic import BaseModel, Field

from tether.child.agent import ChildAgent
from tether.client.child_tool import AgentTool, agent_tool
from tether.contract.messages import AgentToolFailure, AgentToolSuccess
from tether.domain.ids import (
    InvalidIdentifier,
    check_identifier,
    framework_run_id,
    tool_run_id,
)


class ResearchInput(BaseModel):
    query: str = Field(min_length=3, description="what to research")


class Researcher(ChildAgent):
    description = "Research one topic in depth."
    input_model = ResearchInput


class Untyped(ChildAgent):
    agent_type = "notes:Summarizer"
    description = "Summarize."


class FakeParent:
    """Records run_agent_tool calls and answers with a prepared result."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[tuple, dict]] = []

    async def run_agent_tool(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result


def test_the_definition_is_an_openai_style_function_with_the_input_schema() -> None:
    tool = agent_tool("Researcher", description="Research one topic in depth.",
                      display_name="Researcher", input_model=ResearchInput)
    definition = tool.definition()
    assert definition["type"] == "function"
    function = definition["function"]
    assert function["name"] == "Researcher"
    assert function["description"] == "Research one topic in depth."
    assert function["parameters"] == ResearchInput.model_json_schema()
    assert function["parameters"]["properties"]["query"]["minLength"] == 3
    assert function["parameters"]["required"] == ["query"]
    assert tool.display_name == "Researcher"
    assert tool.input_schema == ResearchInput.model_json_schema()


def test_without_an_input_model_any_object_is_accepted() -> None:
    tool = agent_tool("Researcher", description="d")
    assert tool.input_schema == {"type": "object", "additionalProperties": True}
    assert tool.display_name == "Researcher"


def test_a_child_agent_class_gives_its_type_description_and_input_model() -> None:
    tool = agent_tool(Researcher)
    assert (tool.agent_type, tool.name, tool.description) == (
        "Researcher", "Researcher", "Research one topic in depth.")
    assert tool.input_model is ResearchInput
    untyped = agent_tool(Untyped, display_name="Notes")
    assert untyped.agent_type == "notes:Summarizer"
    assert untyped.name == "notes_Summarizer", "a tool name takes no ':'"
    assert untyped.input_model is None
    assert untyped.display_name == "Notes"


def test_a_tool_needs_a_description_a_valid_agent_type_and_name() -> None:
    with pytest.raises(ValueError, match="description"):
        agent_tool("Researcher", description=" ")
    with pytest.raises(InvalidIdentifier, match="agent type"):
        agent_tool("Re searcher", description="d")
    with pytest.raises(ValueError, match="invalid tool name"):
        agent_tool("Researcher", description="d", name="research.deep")


@pytest.mark.parametrize("tool_call_id", [
    "call_abc123", "toolu_01A09q90qw90lq917835lq9", "call/with spaces.and.dots",
    "x" * 200, "日本語", "-leading-dash",
])
def test_tool_run_ids_are_valid_identifiers(tool_call_id: str) -> None:
    run_id = tool_run_id(tool_call_id)
    assert check_identifier(run_id) == run_id
    assert run_id.startswith("agent-tool:")


def test_tool_run_ids_keep_safe_ids_and_never_collide_when_sanitised() -> None:
    assert tool_run_id("call_abc123") == "agent-tool:call_abc123"
    assert tool_run_id("call.1") != tool_run_id("call-1")
    assert tool_run_id("a" * 200) != tool_run_id("a" * 201)
    assert tool_run_id("call.1") == tool_run_id("call.1")
    with pytest.raises(ValueError):
        tool_run_id("")


def test_a_framework_tools_run_id_is_its_call_in_its_thread_and_never_collides() -> None:
    assert framework_run_id("langgraph", "thread-1", "call-1") == "langgraph-thread-1-call-1"
    # The same tool call id in another thread, or the same pair said differently, is
    # another run.
    assert framework_run_id("langgraph", "thread-2", "call-1") != framework_run_id(
        "langgraph", "thread-1", "call-1")
    assert framework_run_id("langgraph", "a.b", "c") != framework_run_id("langgraph", "a-b", "c")
    long = framework_run_id("openai-agents", "x" * 300, "call/1")
    assert check_identifier(long) == long and long.startswith("openai-agents-")
    with pytest.raises(ValueError, match="tool call id"):
        framework_run_id("langgraph", "thread-1", "")


async def test_execute_runs_the_child_for_the_tool_call_and_returns_the_summary() -> None:
    parent = FakeParent(AgentToolSuccess(run_id="agent-tool:call_1", agent_type="Researcher",
                                         summary="HTTP/3 runs over QUIC"))
    tool = agent_tool(Researcher, display_name="Research")
    result = await tool.execute(parent, "call_1", '{"query": "HTTP/3"}', display_order=2)
    assert result == "HTTP/3 runs over QUIC"
    (args, kwargs), = parent.calls
    assert args == ("Researcher", {"query": "HTTP/3"})
    assert kwargs == {"run_id": "agent-tool:call_1", "parent_tool_call_id": "call_1",
                      "display_order": 2, "display": "Research"}


async def test_execute_returns_a_failure_as_a_dict() -> None:
    failure = AgentToolFailure(run_id="agent-tool:c", agent_type="Researcher",
                               status="interrupted", error="no progress", retryable=True,
                               reason="no-progress", child_still_running=True)
    result = await agent_tool(Researcher).execute(FakeParent(failure), "c", {"query": "abc"})
    assert result == {"ok": False, "run_id": "agent-tool:c", "agent_type": "Researcher",
                      "status": "interrupted", "error": "no progress", "retryable": True,
                      "reason": "no-progress", "child_still_running": True}


@pytest.mark.parametrize("bad_input", ['{"query": "ab"}', "{not json", "[1, 2]", {"q": "x"}])
async def test_invalid_input_is_a_failure_for_the_model_and_starts_nothing(bad_input) -> None:
    parent = FakeParent(None)
    result = await agent_tool(Researcher).execute(parent, "call_9", bad_input)
    assert result["ok"] is False and result["status"] == "error"
    assert result["retryable"] is False
    assert result["error"].startswith("invalid input")
    assert parent.calls == []


async def test_a_bound_tool_needs_no_parent_argument() -> None:
    parent = FakeParent(AgentToolSuccess(run_id="r", agent_type="Researcher", summary="ok"))
    tool = agent_tool("Researcher", description="d").bind(parent)
    assert await tool.execute(None, "call_2", None) == "ok"
    assert parent.calls[0][0] == ("Researcher", {})
    with pytest.raises(ValueError, match="not bound"):
        await AgentTool("Researcher", description="d").execute(None, "call_3", {})
