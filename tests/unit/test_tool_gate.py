"""A tool of a child's agent runs only after its attempt's gate (`RunContext.ensure_current`):
an attempt that lost the run (its process was paused past its hold on the run's work item)
runs no tool, so a tool another attempt ran is not run twice. The model agent's loop, and
Pydantic AI's and the OpenAI Agents SDK's tools through Tether's integrations, each with
its framework's own scripted model. (The gate itself, against a real pause: the remote
agents' tests in tests/e2e/test_remote_child_process.py.)"""

import json
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import Model, ModelResponse, Usage, function_tool, set_tracing_disabled
from openai.types.responses import ResponseFunctionToolCall
from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse as PydanticResponse
from pydantic_ai.messages import TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from tether.agents import AgentDefinition, ToolContext, tool
from tether.agents.tool_calls import ToolRunner
from tether.agents.tools import StateAccessor
from tether.child.context import RunContext, RunSuperseded
from tether.domain.events import ParentRef
from tether.integrations import openai_agents, pydantic_ai

set_tracing_disabled(True)
RAN: list[str] = []


@pytest.fixture(autouse=True)
def _nothing_ran() -> None:
    RAN.clear()


class Gated(RunContext):
    """An attempt whose gate lets it act (`lost=False`) or finds the run taken over."""

    def __init__(self, lost: bool) -> None:
        super().__init__(run_id="gated", parent=ParentRef(agent="Assistant", name="gate"),
                         agent_type="Gated", attempt=1, recorder=None)
        self.lost, self.gates = lost, 0

    async def ensure_current(self) -> None:
        self.gates += 1
        RAN.append("gate")
        if self.lost:
            raise RunSuperseded("attempt 2 took the run over")


def superseded(error: BaseException) -> bool:
    """Whether `error` is, or was raised from, the gate's RunSuperseded (a framework may
    wrap what its tool raised)."""
    seen: list[BaseException | None] = [error]
    while seen:
        current = seen.pop()
        if current is None:
            continue
        if isinstance(current, RunSuperseded):
            return True
        if isinstance(current, BaseExceptionGroup):
            seen.extend(current.exceptions)
        seen.extend([current.__cause__, current.__context__])
    return False


# --- the model agent's loop ---------------------------------------------------------------

class Query(BaseModel):
    query: str


@tool
async def search(ctx: ToolContext, input: Query) -> str:
    """Search."""
    RAN.append("search")
    return "found"


def tool_runner(ctx: Gated) -> ToolRunner:
    async def emit(*args: Any, **kwargs: Any) -> None:
        return None

    definition = AgentDefinition(id="researcher", model="small-1", tools=(search,))
    return ToolRunner(definition, tool_execution="auto", emit=emit,
                      context_for=lambda call_id: ToolContext(
                          run_id="gated", agent_id="researcher", tool_call_id=call_id, step=0,
                          state=StateAccessor({})),
                      before_tool=ctx.ensure_current)


@pytest.mark.parametrize("lost", [False, True])
async def test_the_model_agents_tool_runs_after_the_gate_and_not_when_it_stops(lost):
    ctx = Gated(lost)
    runner = tool_runner(ctx)
    call = runner.execute(search, Query(query="QUIC"), ToolContext(run_id="gated", agent_id="researcher",
                                                  tool_call_id="c-1", step=0,
                                                  state=StateAccessor({})),
                          {"query": "QUIC"}, 0, "auto")
    if lost:
        with pytest.raises(RunSuperseded):
            await call
        assert RAN == ["gate"]
    else:
        assert (await call).content == "found"
        assert RAN == ["gate", "search"]


# --- Pydantic AI ---------------------------------------------------------------------------

async def looking_up(messages, info: AgentInfo) -> PydanticResponse:
    last = messages[-1].parts[-1]
    if isinstance(last, ToolReturnPart):
        return PydanticResponse(parts=[TextPart(f"found: {last.content}")])
    return PydanticResponse(parts=[ToolCallPart("lookup", {"query": last.content},
                                                tool_call_id="look-1")])


researcher = Agent(FunctionModel(looking_up), name="GatedResearcher")


@researcher.tool_plain
def lookup(query: str) -> str:
    RAN.append("lookup")
    return f"two sources on {query}"


# --- the OpenAI Agents SDK -------------------------------------------------------------------

class LookingUp(Model):
    async def get_response(self, system_instructions, input, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        return ModelResponse(output=[ResponseFunctionToolCall(
            type="function_call", id="fc-1", call_id="look-1", name="sdk_lookup",
            arguments=json.dumps({"query": input[-1]["content"]}), status="completed")],
            usage=Usage(requests=1, input_tokens=10, output_tokens=1, total_tokens=11),
            response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any):
        raise NotImplementedError


@function_tool
async def sdk_lookup(query: str) -> str:
    """Looks a query up."""
    RAN.append("lookup")
    return f"two sources on {query}"


CHILDREN = {
    "pydantic_ai": pydantic_ai.child(researcher),
    "openai_agents": openai_agents.child(SdkAgent(name="GatedSdkResearcher", model=LookingUp(),
                                                  tools=[sdk_lookup])),
}


@pytest.mark.parametrize("framework", CHILDREN)
async def test_a_frameworks_tool_is_not_run_by_an_attempt_that_lost_the_run(framework):
    child = CHILDREN[framework]
    ctx = Gated(lost=True)
    with pytest.raises(Exception) as raised:
        await child().run(ctx, child.input_model(prompt="QUIC"))
    assert superseded(raised.value), raised.value
    assert RAN == ["gate"]


async def test_a_frameworks_tool_runs_after_the_gate_while_the_attempt_holds_the_run():
    child = CHILDREN["pydantic_ai"]
    ctx = Gated(lost=False)
    assert await child().run(ctx, child.input_model(prompt="QUIC")) == (
        "found: two sources on QUIC")
    assert RAN == ["gate", "lookup"]
