"""An agent's model calls and tools, and a child's nested runs, go through its attempt's
gate (`RunContext.ensure_current`) first: an attempt that lost the run (its process was
paused past its hold on the run's work item) makes no model call, runs no tool and asks
for no nested run, which the attempt that took over may have made already. The agent runtime (`ModelAgent`), and Pydantic AI's and the OpenAI
Agents SDK's agents through Tether's integrations, each with its framework's own scripted
model. (The gate itself, against a real pause: tests/e2e/test_remote_child_process.py.)"""

import json
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import Model, ModelResponse, function_tool, set_tracing_disabled
from framework_agents import sdk_looking_up
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse as PydanticResponse
from pydantic_ai.messages import TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tether.agents import AgentDefinition, ModelAgent, Reply, ScriptedModelClient, ToolContext, tool
from tether.child.context import RunCancelled, RunContext, RunSuperseded
from tether.domain.events import ParentRef
from tether.integrations import openai_agents, pydantic_ai

set_tracing_disabled(True)
RAN: list[str] = []  # "gate", "model" and "lookup", in the order they happened


@pytest.fixture(autouse=True)
def _nothing_ran() -> None:
    RAN.clear()


class Gated(RunContext):
    """An attempt whose gate finds the run taken over at its `lost_at`-th pass (never:
    None), and then stops the child as the runner does: `cancelled`, `RunSuperseded`."""

    def __init__(self, lost_at: int | None) -> None:
        super().__init__(run_id="gated", parent=ParentRef(agent="Assistant", name="gate"),
                         agent_type="Gated", attempt=1, recorder=None)
        self.lost_at, self.passes = lost_at, 0

    async def ensure_current(self) -> None:
        self.passes += 1
        RAN.append("gate")
        if self.passes == self.lost_at:
            self.cancelled.set()
            raise RunSuperseded("attempt 2 took the run over")


def stopped_by_the_gate(error: BaseException) -> bool:
    """Whether `error` is, or was raised from, the gate's stop (a framework may wrap what
    its model or tool raised; the agent runtime ends cancelled)."""
    seen: list[BaseException | None] = [error]
    while seen:
        current = seen.pop()
        if isinstance(current, RunCancelled):
            return True
        if isinstance(current, BaseExceptionGroup):
            seen.extend(current.exceptions)
        if current is not None:
            seen.extend([current.__cause__, current.__context__])
    return False


# --- the agent runtime ----------------------------------------------------------------------

class Query(BaseModel):
    query: str


@tool
async def lookup(ctx: ToolContext, input: Query) -> str:
    """Looks a query up."""
    RAN.append("lookup")
    return f"two sources on {input.query}"


class Counted(ScriptedModelClient):
    async def complete(self, request, on_delta=None):
        RAN.append("model")
        return await super().complete(request, on_delta)


class Researcher(ModelAgent):
    definition = AgentDefinition(id="researcher", model="m", tools=(lookup,))


# --- Pydantic AI --------------------------------------------------------------------------

async def looking_up(messages, info: AgentInfo) -> PydanticResponse:
    RAN.append("model")
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart):
        return PydanticResponse(parts=[TextPart(f"found: {last.content}")])
    return PydanticResponse(parts=[ToolCallPart("pydantic_lookup", {"query": last.content},
                                                tool_call_id="look-1")])


pydantic_researcher = Agent(FunctionModel(looking_up), name="GatedResearcher")


@pydantic_researcher.tool_plain
def pydantic_lookup(query: str) -> str:
    RAN.append("lookup")
    return f"two sources on {query}"


# --- the OpenAI Agents SDK -------------------------------------------------------------------

class LookingUp(Model):
    async def get_response(self, system_instructions, input, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        RAN.append("model")
        return sdk_looking_up(input)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError


@function_tool
async def sdk_lookup(query: str) -> str:
    """Looks a query up."""
    RAN.append("lookup")
    return f"two sources on {query}"


CHILDREN = {
    "agent-runtime": Researcher,
    "pydantic-ai": pydantic_ai.child(pydantic_researcher),
    "openai-agents": openai_agents.child(SdkAgent(name="GatedSdkResearcher",
                                                  model=LookingUp(), tools=[sdk_lookup])),
}


async def run(framework: str, ctx: Gated, monkeypatch) -> Any:
    child = CHILDREN[framework]
    if framework == "agent-runtime":
        monkeypatch.setattr(Researcher, "model_client", Counted(
            [Reply("Looking it up.", [("lookup", {"query": "QUIC"})]),
             Reply("found: two sources on QUIC")]))
        return await child().run(ctx, child.input_model(input="QUIC"))
    return await child().run(ctx, child.input_model(prompt="QUIC"))


@pytest.mark.parametrize("framework", CHILDREN)
async def test_each_model_call_and_tool_passes_the_gate_first(framework, monkeypatch):
    output = await run(framework, Gated(lost_at=None), monkeypatch)
    assert "found: two sources on QUIC" in json.dumps(output)
    assert RAN == ["gate", "model", "gate", "lookup", "gate", "model"]


@pytest.mark.parametrize("framework", CHILDREN)
@pytest.mark.parametrize(("lost_at", "ran"), [(1, ["gate"]),
                                              (2, ["gate", "model", "gate"])],
                         ids=["before-the-model-call", "before-the-tool"])
async def test_an_attempt_that_lost_the_run_makes_no_call_after_the_gate(
        framework, lost_at, ran, monkeypatch):
    with pytest.raises(Exception) as raised:
        await run(framework, Gated(lost_at), monkeypatch)
    assert stopped_by_the_gate(raised.value), raised.value
    assert RAN == ran


async def test_an_attempt_that_lost_the_run_asks_for_no_nested_run():
    """A nested run (a follow-up turn of one, say) asked for by an attempt that lost the
    run would be asked for twice: the gate stops the attempt first."""
    asked: list[str] = []

    class Client:
        async def run_agent_tool(self, agent_type: str, input: dict, **options: Any):
            asked.append(agent_type)

    ctx = Gated(lost_at=1)
    ctx._client = Client()
    ctx._recorder = object()  # in a run (the gate is Gated's own)
    with pytest.raises(RunSuperseded):
        await ctx.run_agent_tool("Researcher", {"query": "QUIC"}, follow_up="r-1")
    assert (asked, RAN) == ([], ["gate"])
