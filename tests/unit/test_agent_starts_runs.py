"""Tools that start runs (agent tools): the model turn is recorded before they run,
their calls run at once, and a run resumed from the records joins them without asking
the model again."""

import asyncio

from pydantic import BaseModel

from tether.agents import (
    Agent,
    AgentDefinition,
    ModelRetry,
    Reply,
    ScriptedModelClient,
    StateAccessor,
    Tool,
    ToolContext,
)
from tether.agents.in_process import input_messages
from tether.agents.loop import AgentLoop
from tether.agents.loop_ports import CallPlan, LoopPorts, Session
from tether.agents.model_messages import ToolCall
from tether.agents.steps import AgentStepRecord
from tether.domain.ids import tool_run_id


class Topic(BaseModel):
    topic: str


class Journal:
    def __init__(self) -> None:
        self.records: list[AgentStepRecord] = []

    async def record(self, record: AgentStepRecord) -> AgentStepRecord:
        self.records.append(record)
        return record


def delegate(started: list[str], both: asyncio.Event) -> Tool:
    async def execute(ctx: ToolContext, input: Topic) -> str:
        started.append(input.topic)
        if len(started) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), timeout=2)  # a sequential fan-out times out
        return f"found {input.topic}"

    return Tool(id="research", description="Research a topic.", input_model=Topic,
                execute=execute, starts_run=True)


SCRIPT = [Reply("", [("research", {"topic": "QUIC"}), ("research", {"topic": "UDP"})]),
          Reply("QUIC runs over UDP.")]


async def test_the_turn_is_recorded_before_its_runs_which_run_at_once() -> None:
    started: list[str] = []
    journal = Journal()
    definition = AgentDefinition(id="planner", model="m",
                                 tools=(delegate(started, asyncio.Event()),))
    result = await Agent(definition).run("research", client=ScriptedModelClient(SCRIPT),
                                         journal=journal)

    assert result.output == "QUIC runs over UDP."
    assert [(r.kind, r.status, [p.reason for p in r.pending],
             [t.content for t in r.tool_results]) for r in journal.records] == [
        ("model_turn", "running", ["run", "run"], []),
        ("continuation", "running", [], ["found QUIC", "found UDP"]),
        ("model_turn", "completed", [], [])]


async def test_a_run_resumed_after_the_turn_joins_its_runs_without_a_model_call() -> None:
    first = Journal()
    definition = AgentDefinition(id="planner", model="m",
                                 tools=(delegate([], asyncio.Event()),))
    await Agent(definition).run("research", client=ScriptedModelClient(SCRIPT), journal=first)
    recorded_turn = first.records[:1]  # the process died as the runs went on

    started: list[str] = []
    resumed = AgentDefinition(id="planner", model="m",
                              tools=(delegate(started, asyncio.Event()),))
    client = ScriptedModelClient(SCRIPT)
    session = Session(input=input_messages("research"), records=list(recorded_turn),
                      state=StateAccessor())
    outcome = await AgentLoop(resumed, LoopPorts(client=client)).drive(
        session, CallPlan(run_id="r", call=0, max_steps=10, retry=ModelRetry()))

    assert outcome.status == "completed"
    assert sorted(started) == ["QUIC", "UDP"], "the runs were joined again"
    assert [call.turn for call in client.calls] == [1], "turn 0 was not asked again"
    assert [r.kind for r in session.records] == ["model_turn", "continuation", "model_turn"]


def recorder(ids: list[str]) -> Tool:
    async def execute(ctx: ToolContext, input: Topic) -> str:
        ids.append(ctx.tool_call_id)
        return f"found {input.topic}"

    return Tool(id="research", description="Research a topic.", input_model=Topic,
                execute=execute, starts_run=True)


def call(call_id: str, topic: str) -> ToolCall:
    return ToolCall(id=call_id, name="research", input={"topic": topic})


# A provider that sends no id, repeats one within a turn, and numbers its calls per turn.
CARELESS = [Reply("", [call("", "QUIC"), call("call_0", "UDP"), call("call_0", "TCP")]),
            Reply("", [call("call_0", "TLS"), call("  ", "DNS")]),
            Reply("done")]


async def test_tool_call_ids_name_one_call_each_whatever_the_provider_sends() -> None:
    ids: list[str] = []
    journal = Journal()
    definition = AgentDefinition(id="planner", model="m", tools=(recorder(ids),))
    result = await Agent(definition).run("research", client=ScriptedModelClient(CARELESS),
                                         journal=journal)

    assert result.output == "done"
    assert sorted(ids) == sorted(["tether_0_0", "call_0", "tether_0_2", "tether_2_0",
                                  "tether_2_1"])
    # An agent tool's run id derives from the call's id: one run per call.
    assert len({tool_run_id(i) for i in ids}) == len(ids) == 5
    # What was recorded (and goes back to the provider) carries the same ids.
    recorded = [c.id for r in journal.records for c in r.tool_calls]
    assert sorted(recorded) == sorted(ids)
    answered = [t.tool_call_id for r in journal.records for t in r.tool_results]
    assert sorted(answered) == sorted(ids)


async def test_a_resumed_turn_keeps_the_ids_it_was_recorded_with() -> None:
    first = Journal()
    definition = AgentDefinition(id="planner", model="m", tools=(recorder([]),))
    await Agent(definition).run("research", client=ScriptedModelClient(CARELESS),
                                journal=first)

    ids: list[str] = []
    resumed = AgentDefinition(id="planner", model="m", tools=(recorder(ids),))
    session = Session(input=input_messages("research"), records=list(first.records[:1]),
                      state=StateAccessor())
    client = ScriptedModelClient(CARELESS)
    await AgentLoop(resumed, LoopPorts(client=client)).drive(
        session, CallPlan(run_id="r", call=0, max_steps=10, retry=ModelRetry()))

    assert sorted(ids[:3]) == ["call_0", "tether_0_0", "tether_0_2"], "the recorded ids"
