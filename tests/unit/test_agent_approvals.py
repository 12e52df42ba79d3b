"""Human review in-process: pauses for approval or tool outputs, and continue calls."""

from typing import Any

import pytest
from pydantic import BaseModel

from tether.agents import (
    Agent,
    AgentDefinition,
    Decisions,
    Reply,
    ReviewRequest,
    ScriptedModelClient,
    Tool,
    ToolContext,
    tool,
)
from tether.agents.model_messages import ModelRequest


class Payment(BaseModel):
    amount: int


class Lookup(BaseModel):
    city: str


paid: list[int] = []


@tool(needs_approval=lambda input, ctx: input.amount > 100)
async def pay(ctx: ToolContext, input: Payment) -> str:
    """Pay an amount; large ones need approval."""
    paid.append(input.amount)
    return f"paid {input.amount}"


weather = Tool(id="weather", description="The weather, looked up by the caller",
               input_model=Lookup)  # no execute: it runs outside the agent


def definition(**overrides: Any) -> AgentDefinition:
    return AgentDefinition(**({"id": "cashier", "model": "m", "tools": (pay, weather)}
                              | overrides))


def echo_tools(request: ModelRequest) -> Reply:
    """The model repeats what the tools answered, so a test can read it in the output."""
    return Reply(" | ".join(m.content for m in request.messages if m.role == "tool"))


@pytest.fixture(autouse=True)
def _reset() -> None:
    paid.clear()


def two_payments() -> ScriptedModelClient:
    return ScriptedModelClient([
        Reply("Paying.", [("pay", {"amount": 50}), ("pay", {"amount": 500})]), echo_tools])


async def test_a_call_that_needs_approval_pauses_and_an_approval_runs_it() -> None:
    agent = Agent(definition(), client=two_payments())
    paused = await agent.run("pay both")
    assert paused.status == "waiting_for_human" and paused.output is None
    assert paid == [50], "the call that needs no approval ran at once"
    [pending] = paused.pause.pending
    assert (pending.tool_name, pending.input, pending.reason) == ("pay", {"amount": 500},
                                                                  "approval")
    assert paused.record.ended_at is None
    assert [i.status for i in paused.items if i.type == "tool_call"] == ["completed", "pending"]

    done = await agent.continue_run(paused, approvals=[pending.tool_call_id])
    assert (done.status, done.output) == ("completed", "paid 50 | paid 500")
    assert paid == [50, 500]
    assert [(s.kind, s.call, s.status) for s in done.steps] == [
        ("model_turn", 0, "waiting_for_human"), ("continuation", 1, "running"),
        ("model_turn", 1, "completed")]
    assert [i.status for i in done.items if i.type == "tool_call"] == ["completed", "approved"]


async def test_a_rejection_tells_the_model_and_runs_nothing() -> None:
    agent = Agent(definition(), client=two_payments())
    paused = await agent.run("pay both")
    call_id = paused.pause.pending[0].tool_call_id
    done = await agent.continue_run(paused, rejections=[{"tool_call_id": call_id,
                                                         "reason": "too much"}])
    assert done.output == "paid 50 | Error: The user rejected this tool call: too much."
    assert paid == [50]
    assert done.steps[1].tool_results[0].decision == "rejected"


async def test_a_tool_that_runs_outside_waits_for_its_output() -> None:
    client = ScriptedModelClient([Reply("", [("weather", {"city": "Oslo"})]), echo_tools])
    agent = Agent(definition(), client=client)
    paused = await agent.run("weather?")
    assert paused.status == "waiting_for_tools"
    call_id = paused.pause.pending[0].tool_call_id
    assert paused.pause.pending[0].reason == "external"

    still = await agent.continue_run(paused, approvals=[call_id])
    assert still.status == "waiting_for_tools", "approving cannot run a tool that is not here"
    done = await agent.continue_run(still, tool_outputs={call_id: {"celsius": -3}})
    assert (done.status, done.output) == ("completed", '{"celsius": -3}')
    assert done.steps[-2].tool_results[0].decision == "provided"


async def test_manual_tool_execution_hands_every_call_to_the_caller() -> None:
    client = ScriptedModelClient([Reply("", [("pay", {"amount": 5})]), echo_tools])
    agent = Agent(definition(), client=client)
    paused = await agent.run("pay", tool_execution="manual")
    assert paused.status == "waiting_for_tools" and paid == []
    done = await agent.continue_run(paused, tool_outputs=[
        {"tool_call_id": paused.pause.pending[0].tool_call_id, "output": "done by hand"}])
    assert done.output == "done by hand" and paid == []


async def test_partial_answers_keep_the_rest_waiting_and_human_input_declines_them() -> None:
    client = ScriptedModelClient([
        Reply("", [("pay", {"amount": 200}), ("pay", {"amount": 300})]), echo_tools,
        lambda request: Reply(f"you said: {request.messages[-1].content}")])
    agent = Agent(definition(), client=client)
    paused = await agent.run("pay")
    first, second = (p.tool_call_id for p in paused.pause.pending)
    partial = await agent.continue_run(paused, approvals=[first])
    assert partial.status == "waiting_for_human" and paid == [200]
    assert [p.tool_call_id for p in partial.pause.pending] == [second]

    answered = await agent.continue_run(partial, human_input="not the second one")
    assert answered.output == ("paid 200 | Error: The user did not approve this tool call and "
                               "replied instead.")
    assert answered.messages[-2].content == "not the second one"
    chat = await agent.continue_run(answered, human_input="thanks")
    assert chat.output == "you said: thanks"
    with pytest.raises(ValueError, match="human_input"):
        await agent.continue_run(chat)


async def test_the_review_callback_decides_at_once_or_lets_the_run_pause() -> None:
    seen: list[ReviewRequest] = []

    async def reviewer(request: ReviewRequest) -> Decisions | None:
        seen.append(request)
        if request.context.get("auto_approve"):
            return Decisions.of(approvals=[p.tool_call_id for p in request.pending])
        return None

    agent = Agent(definition(human_review=reviewer), client=two_payments())
    done = await agent.run("pay", context={"auto_approve": True})
    assert (done.status, done.output) == ("completed", "paid 50 | paid 500")
    assert seen[0].pending[0].input == {"amount": 500}

    paused = await Agent(definition(human_review=reviewer), client=two_payments()).run(
        "pay", context={})
    assert paused.status == "waiting_for_human"


async def test_stop_when_on_run_is_accepted_and_ignored_as_the_seed_says() -> None:
    agent = Agent(definition(), client=ScriptedModelClient([Reply("hi")]))
    with pytest.warns(UserWarning, match="stop_when"):
        result = await agent.run("hi", stop_when=[lambda state: (True, "never used")])
    assert result.status == "completed"


async def test_human_input_given_while_outputs_are_awaited_follows_them() -> None:
    client = ScriptedModelClient([
        Reply("", [("weather", {"city": "Oslo"})]),
        lambda request: Reply(" / ".join(f"{m.role}:{m.content}" for m in request.messages[1:]))])
    agent = Agent(definition(), client=client)
    paused = await agent.run("weather?")
    call_id = paused.pause.pending[0].tool_call_id
    still = await agent.continue_run(paused, human_input="in celsius, please")
    assert still.status == "waiting_for_tools" and len(client.calls) == 1
    done = await agent.continue_run(still, tool_outputs={call_id: "-3"})
    assert done.output == "assistant: / tool:-3 / user:in celsius, please"
