"""Model agents in the child-runner (and the parent service) against real NATS.

The agents are examples.model_agents' Researcher and Publisher, and a Cashier defined
here; each test gives them a fresh scripted client, so what the model is asked can be
checked. Commands go to the parent as JSON on `tether.cmd.*`, as any NATS client sends
them; nothing here sleeps to wait: every wait follows the run's events.
"""

import asyncio
import io
import json
import os
import sys
import uuid
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import msgspec
import pytest
from eventually import eventually
from parent_service import running_parent
from pydantic import BaseModel

from examples.model_agents import Publisher, Researcher
from tether.adapters.event_log import EventLog
from tether.adapters.postgres.projector import Projector
from tether.agent_registry import AgentRegistry
from tether.agents import (
    Agent,
    AgentDefinition,
    Fail,
    ModelAgent,
    Reply,
    ScriptedModelClient,
    Tool,
    ToolContext,
    tool,
)
from tether.agents.clients.scripted import read_calls
from tether.agents.devtools import show_run
from tether.child.runner import consumer_name
from tether.child.work import Outcome
from tether.contract.messages import CancelSignal, InspectReply, WorkItem, work_item_json
from tether.domain import events as ev
from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.ids import work_message_id
from tether.domain.run_state import RunState
from tether.testing import RunEvents
from tether_services.child_runner import open_runner

PARENT = ParentRef(agent="Assistant", name="user-7")
TERMINAL = {"run.completed", "run.failed", "run.aborted"}


class Amount(BaseModel):
    amount: int


class City(BaseModel):
    city: str


@tool
async def pay(ctx: ToolContext, input: Amount) -> str:
    """Pay a small amount."""
    return f"paid {input.amount}"


class Cashier(ModelAgent):
    definition = AgentDefinition(
        id="cashier", model="m", max_steps=2,
        tools=(pay, Tool(id="weather", description="Looked up by the caller", input_model=City)))


AGENTS = (Researcher, Publisher, Cashier)


@pytest.fixture
def scripted(monkeypatch) -> Callable[..., ScriptedModelClient]:
    def give(agent: type[ModelAgent], script: list | None = None,
             **options: Any) -> ScriptedModelClient:
        client = ScriptedModelClient(script if script is not None else agent.script, **options)
        monkeypatch.setattr(agent, "model_client", client)
        return client
    return give


@pytest.fixture
async def runner(nc, log, settings):
    outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
    child_runner = await open_runner(nc, settings.model_copy(update={"work_ack_wait_ms": 1500}),
                               AgentRegistry(AGENTS), on_outcome=outcomes.put_nowait,
                               fetch_timeout_s=0.3, cancel_grace_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(child_runner.run(stop))
    child_runner.outcomes = outcomes
    yield child_runner
    stop.set()
    await asyncio.wait_for(task, timeout=10)


@pytest.fixture
async def parent(settings, log, pool):
    async with running_parent(settings, log, pool, AGENTS) as service:
        yield service


async def command(log: EventLog, kind: str, **payload: Any) -> None:
    body = {"parent": msgspec.to_builtins(PARENT), **payload}
    await log.jetstream.publish(log.subjects.command(kind), json.dumps(body).encode())


async def until(log: EventLog, run_id: str, done: Callable[[RunState, list[Event]], bool],
                timeout: float = 10) -> tuple[RunState, list[Event]]:
    """Follow the run's events (replayed, then live) until `done(state, events)`."""
    state, events = None, []
    async with asyncio.timeout(timeout), aclosing(
            log.follow(log.subjects.run_events(PARENT, run_id))) as stream:
        async for stored in stream:
            events.append(stored.event)
            state = evolve(state, stored.event).state
            if state is not None and done(state, events):
                return state, events
    raise AssertionError("unreachable")


def ended(state: RunState, events: list[Event]) -> bool:
    return events[-1].type in TERMINAL


def of_type(events: list[Event], event_type: str) -> list[Event]:
    return [e for e in events if e.type == event_type]


async def dispatch(log: EventLog, agent_type: str, input: dict[str, Any],
                   recorded: Callable[[RunEvents], list[Event]] = lambda run: []) -> str:
    """A run as the parent would register it, with events already `recorded` if given."""
    run = RunEvents(f"r-{uuid.uuid4().hex[:8]}", PARENT)
    await log.append_batch([run.requested(agent_type, input=input), run.started(),
                            *recorded(run)], expected_last_seq=0)
    item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type=agent_type)
    await log.jetstream.publish(log.subjects.work(agent_type), work_item_json(item),
                                headers={"Nats-Msg-Id": work_message_id(run.run_id, 1)},
                                stream=log.subjects.work_stream)
    return run.run_id


async def work_items_left(log: EventLog, agent_type: str) -> tuple[int, int]:
    info = await log.jetstream.consumer_info(log.subjects.work_stream, consumer_name(agent_type))
    return info.num_pending, info.num_ack_pending


async def equals(probe: Callable[[], Any], expected: Any, timeout: float = 3) -> None:
    """An acknowledgement is not confirmed to its sender, so poll the server for it."""
    async def found() -> bool:
        return await probe() == expected

    await eventually(found, timeout=timeout, interval=0.01)


# --- steps and output ----------------------------------------------------------------


async def test_each_step_is_recorded_before_the_next_and_the_answer_streams(
        log, runner, scripted):
    client = scripted(Researcher)
    run_id = await dispatch(log, "Researcher", {"input": "What does HTTP/3 run over?",
                                                "context": {"audience": "children"}})
    state, events = await until(log, run_id, ended)

    assert state.status == "completed"
    answer = "HTTP/3 runs over QUIC, which runs over UDP (2 searches)."
    assert state.summary == answer
    assert state.output_text == ("Searching for sources.\n\nChecking the transport underneath."
                                 f"\n\n{answer}")
    assert (state.output["status"], state.output["steps"], state.output["model"]) == (
        "completed", 3, "demo-small")
    assert state.output["usage"]["cost"] > 0
    # Step n is in the log before any text of step n+1 was streamed.
    position = {id(e): i for i, e in enumerate(events)}
    steps = of_type(events, "run.step_recorded")
    outputs = of_type(events, "run.output")
    assert len(outputs) > 10, "the answer arrives in chunks, as the model writes it"
    second_turn = next(e for e in outputs if e.data.text.startswith("\n\nChecking"))
    third_turn = next(e for e in outputs if e.data.text.startswith("\n\nHTTP/3"))
    assert position[id(steps[0])] < position[id(second_turn)]
    assert position[id(steps[1])] < position[id(third_turn)]
    assert [(s["index"], s["status"], s["milestones"]) for s in state.steps.values()] == [
        (0, "running", ["sources-gathered"]), (1, "running", ["sources-gathered"]),
        (2, "completed", [])]
    assert [m.name for m in state.milestones] == ["sources-gathered", "sources-gathered"]
    assert (state.progress.phase, state.progress.message) == ("model_turn", "step 3: answered")
    assert client.requests[0].instructions.startswith("You research technical topics for "
                                                      "children")
    assert [c.turn for c in client.calls] == [0, 1, 2]


async def test_a_resumed_run_repeats_no_recorded_model_call_tool_or_milestone(
        log, runner, scripted, tmp_path, monkeypatch):
    first = await Agent(Researcher.definition, client=ScriptedModelClient(Researcher.script)
                        ).run("What does HTTP/3 run over?", max_steps=1)
    # As the first runner recorded it: the loop went on after this step (no step limit).
    step = first.steps[0].model_copy(update={"status": "running", "stop_reason": None,
                                             "milestones": ("sources-gathered",)})

    def died_after_step_0(run: RunEvents) -> list[Event]:
        return [run.running(attempt=1), run.output("Searching for sources."),
                run.milestone("sources-gathered", {"sources": 2}),
                run.make(ev.RunStepRecorded, index=0, step=step.model_dump(mode="json"))]

    tools = tmp_path / "tools.jsonl"
    monkeypatch.setenv("TETHER_EXAMPLE_TOOL_LOG", str(tools))
    client = scripted(Researcher, [Fail(AssertionError("turn 0 was called again")),
                                   *Researcher.script[1:]])
    run_id = await dispatch(log, "Researcher", {"input": "What does HTTP/3 run over?"},
                            died_after_step_0)
    state, _ = await until(log, run_id, ended)

    assert state.status == "completed" and state.attempt == 2
    assert [c.turn for c in client.calls] == [1, 2]
    assert [line["tool"] for line in read_calls(tools)] == ["search:QUIC"]
    assert [(m.sequence, m.name) for m in state.milestones] == [(0, "sources-gathered"),
                                                                 (1, "sources-gathered")]
    assert state.output_text.count("Searching for sources.") == 1
    assert sorted(state.steps) == [0, 1, 2]
    assert state.steps[0] == step.model_dump(mode="json")
    # The conversation the model saw was rebuilt from the recorded step.
    assert [m.role for m in client.requests[0].messages] == ["user", "assistant", "tool"]


# --- human review ------------------------------------------------------------------


async def inspect(log: EventLog, run_id: str) -> InspectReply:
    reply = await log.nats.request(log.subjects.rpc("inspect"), json.dumps(
        {"run_id": run_id, "parent": msgspec.to_builtins(PARENT)}).encode(), timeout=5)
    return InspectReply.model_validate_json(reply.data)


async def start_publisher(log: EventLog) -> tuple[str, RunState, list[Event]]:
    run_id = f"pub-{uuid.uuid4().hex[:6]}"
    await command(log, "run", run_id=run_id, agent_type="Publisher",
                  input={"input": "Write a note about HTTP/3 and publish it."})
    state, events = await until(log, run_id, lambda s, e: any(
        m.name == "needs-approval" for m in s.milestones))
    return run_id, state, events


@pytest.mark.parametrize("decision", ["approvals", "rejections"])
async def test_an_approval_pauses_the_run_and_continue_resumes_it_in_a_runner(
        log, parent, runner, scripted, decision):
    client = scripted(Publisher)
    run_id, state, events = await start_publisher(log)

    [paused] = of_type(events, "run.paused")
    [pending] = paused.data.pending
    assert (paused.data.reason, pending["tool_name"], pending["reason"]) == (
        "waiting_for_human", "publish", "approval")
    milestone = state.milestones[-1]
    assert milestone.data == {"pause_id": paused.event_id, "reason": "waiting_for_human",
                              "pending": [pending]}
    assert state.status == "running" and not of_type(events, "run.completed")
    outcome = await asyncio.wait_for(runner.outcomes.get(), 5)
    assert (outcome.kind, outcome.detail) == ("paused", "waiting_for_human: 1 pending")
    await equals(lambda: work_items_left(log, "Publisher"), (0, 0))  # acknowledged
    snapshot = (await inspect(log, run_id)).run
    assert (snapshot.status, snapshot.waiting_for) == ("running", "waiting_for_human")

    await command(log, "continue", run_id=run_id, **{decision: [pending["tool_call_id"]]})
    state, events = await until(log, run_id, ended)

    assert state.status == "completed"
    if decision == "approvals":
        assert state.summary == f"Published: https://notes.example/{run_id}"
    else:
        assert state.summary == ("I did not publish the note. (Error: The user rejected this "
                                 "tool call.)")
    assert [e.data.attempt for e in of_type(events, "run.running")] == [1, 2]
    assert [(s["kind"], s["call"], s["status"]) for s in state.steps.values()] == [
        ("model_turn", 0, "running"), ("model_turn", 0, "waiting_for_human"),
        ("continuation", 1, "running"), ("model_turn", 1, "completed")]
    assert [c.turn for c in client.calls] == [0, 1, 2], "no model turn was asked twice"
    assert (await inspect(log, run_id)).run.waiting_for is None


async def test_a_continue_that_answers_nothing_leaves_the_run_paused_again(
        log, parent, runner, scripted):
    scripted(Publisher)
    run_id, _, events = await start_publisher(log)
    [pending] = of_type(events, "run.paused")[0].data.pending

    await command(log, "continue", run_id=run_id)  # no answer at all
    state, events = await until(log, run_id, lambda s, e: len(of_type(e, "run.paused")) == 2)
    first, second = of_type(events, "run.paused")
    assert first.event_id != second.event_id and state.paused.pause_id == second.event_id
    assert second.data.pending == [pending]

    await command(log, "continue", run_id=run_id, approvals=[pending["tool_call_id"]])
    state, _ = await until(log, run_id, ended)
    assert state.summary == f"Published: https://notes.example/{run_id}"


async def test_tool_outputs_answer_a_run_waiting_for_tools_with_a_fresh_step_limit(
        log, parent, runner, scripted):
    client = scripted(Cashier, [
        Reply("Checking the weather.", [("weather", {"city": "Oslo"})]),
        Reply("Cold; paying for a coat.", [("pay", {"amount": 5})]),
        Reply("And gloves.", [("pay", {"amount": 6})]),
        Reply("never asked: the continue call had two steps")])
    run_id = f"cash-{uuid.uuid4().hex[:6]}"
    await command(log, "run", run_id=run_id, agent_type="Cashier", input={"input": "Dress me."})
    state, _ = await until(log, run_id, lambda s, e: s.paused is not None)
    assert state.paused.reason == "waiting_for_tools"
    call_id = state.paused.pending[0]["tool_call_id"]
    await until(log, run_id, lambda s, e: any(m.name == "needs-tool-output"
                                              for m in s.milestones))

    await command(log, "continue", run_id=run_id, tool_outputs={call_id: {"celsius": -3}})
    state, _ = await until(log, run_id, ended)
    assert (state.status, state.summary) == ("completed", "And gloves.")
    assert (state.output["status"], state.output["stop_reason"]) == ("stopped", "max_steps")
    assert [(s["kind"], s["call"]) for s in state.steps.values()] == [
        ("model_turn", 0), ("continuation", 1), ("model_turn", 1), ("model_turn", 1)]
    assert state.steps[1]["tool_results"][0]["content"] == '{"celsius": -3}'
    assert len(client.calls) == 3


async def test_a_stale_work_item_for_a_paused_run_adds_its_missing_milestone(log, runner):
    pending = [{"tool_call_id": "call_1_0", "tool_name": "publish", "input": {},
                "reason": "approval"}]

    def paused_then_died(run: RunEvents) -> list[Event]:
        return [run.running(attempt=1),
                run.make(ev.RunPaused, reason="waiting_for_human", pending=pending)]

    run_id = await dispatch(log, "Publisher", {"input": "x"}, paused_then_died)
    outcome = await asyncio.wait_for(runner.outcomes.get(), 5)
    assert (outcome.run_id, outcome.kind) == (run_id, "skipped")
    history = await log.read_run(PARENT, run_id)
    [milestone] = history.state.milestones
    assert milestone.name == "needs-approval"
    assert milestone.data["pause_id"] == history.state.paused.pause_id
    assert len(of_type(list(history.events), "run.running")) == 1


# --- streams, cancellation, devtools ---------------------------------------------------


async def test_several_consumers_each_read_the_run_from_the_start(log, runner, scripted):
    scripted(Researcher)
    run_id = await dispatch(log, "Researcher", {"input": "HTTP/3?"})
    early, _ = await asyncio.gather(until(log, run_id, ended), until(log, run_id, ended))
    late = await until(log, run_id, ended)
    assert [e.event_id for e in early[1]] == [e.event_id for e in late[1]]
    assert early[1][0].type == "run.requested" and early[0] == late[0]


async def test_a_cancel_stops_a_model_agent_mid_answer(log, runner, scripted, nc):
    scripted(Researcher, [Reply("word " * 200, chunk_delay_ms=20)])
    run_id = await dispatch(log, "Researcher", {"input": "talk"})
    await until(log, run_id, lambda s, e: len(s.output_parts) >= 2)
    await nc.publish(log.subjects.cancel_signal("Researcher"),
                     CancelSignal(run_id=run_id, parent=PARENT).model_dump_json().encode())
    state, _ = await until(log, run_id, ended)
    assert (state.status, state.steps) == ("aborted", {})


async def tether_cli(settings: Any, *args: str) -> tuple[int, str, str]:
    """The `tether` command in its own process (it configures logging for the process)."""
    env = {**os.environ, "TETHER_DATABASE_URL": settings.database_url,
           "TETHER_PROJECTION_SCHEMA": settings.projection_schema, "TETHER_PREFIX": settings.prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    return process.returncode, out.decode(), err.decode()


async def test_runs_show_prints_steps_tool_calls_usage_and_timings(
        log, parent, runner, scripted, pool, settings):
    scripted(Publisher)
    run_id, state, _ = await start_publisher(log)
    await command(log, "continue", run_id=run_id,
                  approvals=[state.paused.pending[0]["tool_call_id"]])
    await until(log, run_id, ended)
    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    await asyncio.wait_for(projector.wait_for_position(await log.stream_last_seq()), 10)
    stop.set()
    await asyncio.wait_for(task, 10)

    out = io.StringIO()
    assert await show_run(settings, PARENT, run_id, out=out) == 0
    text = out.getvalue()
    assert f"run {run_id}  Publisher  parent Assistant/user-7" in text
    assert "status    completed  attempt 2" in text
    assert "#1   model turn  call 0  demo-small" in text and "-> waiting_for_human" in text
    assert "tool  search [auto]" in text and "tool  publish [approved]" in text
    assert "#2   continuation  call 1" in text and "continue  " in text
    assert "usage     in " in text and "cost $" in text
    assert f"summary   Published: https://notes.example/{run_id}" in text

    code, out, _ = await tether_cli(settings, "runs", "show", run_id, "--parent",
                                    "Assistant/user-7")
    assert code == 0 and out.strip() == text.strip()
    code, _, err = await tether_cli(settings, "runs", "show", "nope", "--parent",
                                    "Assistant/user-7")
    assert code == 1 and "no run 'nope'" in err
