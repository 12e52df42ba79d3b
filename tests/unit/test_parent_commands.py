"""The parent's command handlers against the in-memory event log: what each command
appends, publishes and answers. tests/integration/test_parent.py runs them in the
service against a real server."""

import asyncio
import json

import msgspec
import pytest
from pydantic import BaseModel

from tether.agent_registry import AgentRegistry
from tether.child.agent import ChildAgent
from tether.contract.messages import CancelSignal, WorkItem, read_work_item
from tether.domain import decide
from tether.domain.events import ParentRef, RunCancelRequested
from tether.parent.command_parsing import UnparseableCommand
from tether.parent.handlers import CommandHandlers
from tether.testing import FakeClock, InMemoryEventLog, RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


class Query(BaseModel):
    query: str


class Researcher(ChildAgent):
    input_model = Query


async def _always_registered(parent_agent: str, method: str) -> bool:
    return method == "on_done"


def _handlers(log: InMemoryEventLog, *, max_input_bytes: int = 1024,
              clock: FakeClock | None = None) -> CommandHandlers:
    return CommandHandlers(log, AgentRegistry([Researcher]),
                           budgets=decide.Budgets(detached_max_budget_ms=60_000,
                                                  detached_no_progress_budget_ms=10_000),
                           slots=None, default_cap=None, max_input_bytes=max_input_bytes,
                           hook_registered=_always_registered, clock=clock or FakeClock())


def _run(run_id: str = "r1", **overrides) -> dict:
    return {"run_id": run_id, "parent": msgspec.to_builtins(PARENT), "agent_type": "Researcher",
            "input": {"query": "HTTP/3"}, **overrides}


def _types(log: InMemoryEventLog, run_id: str = "r1") -> list[str]:
    return [m.subject.rsplit(".", 1)[-1] + ":" + json.loads(m.data)["type"]
            for m in log.messages(log.subjects.events_stream,
                                  log.subjects.run_events(PARENT, run_id))]


def _work(log: InMemoryEventLog) -> list[WorkItem]:
    return [read_work_item(m.data)
            for m in log.messages(log.subjects.work_stream)]


@pytest.fixture
def log() -> InMemoryEventLog:
    return InMemoryEventLog()


async def test_a_new_run_is_requested_and_dispatched_with_its_request(log):
    outcome = await _handlers(log).run(_run(), seq=7)

    assert (outcome.decision, outcome.status) == ("created", "starting")
    assert _types(log) == ["r1:run.requested"]
    [item] = _work(log)
    assert (item.run_id, item.dispatch, item.requested_seq) == ("r1", 1, 1)
    assert item.requested is not None and item.requested.data.input == {"query": "HTTP/3"}


async def test_what_the_handlers_decide_is_stamped_by_their_clock(log):
    clock = FakeClock(now=1_800_000_000_000)
    await _handlers(log, clock=clock).run(_run(), seq=7)
    clock.advance(5_000)
    await _handlers(log, clock=clock).cancel({"run_id": "r1", "parent": msgspec.to_builtins(PARENT)},
                                            seq=8)

    stamps = [json.loads(m.data)["occurred_at"] for m in log.messages(log.subjects.events_stream)]
    assert stamps[:2] == [1_800_000_000_000, 1_800_000_005_000]


async def test_a_repeated_request_never_starts_a_second_child_turn(log):
    handlers = _handlers(log)
    await handlers.run(_run(), seq=7)
    again = await handlers.run(_run(), seq=8)

    assert (again.decision, again.status) == ("redispatched", "starting")
    assert _types(log) == ["r1:run.requested"]
    # The work item goes out again with the same message id: the stream keeps one.
    assert len(_work(log)) == 1


async def test_two_replicas_requesting_one_run_id_at_once_create_it_once(log):
    outcomes = await asyncio.gather(_handlers(log).run(_run(), seq=1),
                                    _handlers(log).run(_run(), seq=2))

    assert sorted(o.decision for o in outcomes) == ["created", "redispatched"]
    assert _types(log) == ["r1:run.requested"]
    assert len(_work(log)) == 1


@pytest.mark.parametrize(("request_overrides", "code"), [
    ({"agent_type": "Nobody"}, "unknown-agent-type"),
    ({"input": {"query": 3}}, "invalid-input"),
    ({"input": {"query": "x" * 2000}}, "input-too-large"),
    ({"detached": {"on_finish": "on_missing"}}, "unknown-hook"),
    ({"agent_type": "no spaces"}, "invalid-request"),
])
async def test_a_request_that_cannot_run_is_answered_with_a_rejection(
        log, request_overrides, code):
    outcome = await _handlers(log).run(_run(**request_overrides), seq=3)

    assert (outcome.decision, outcome.code) == ("rejected", code)
    [rejection] = log.messages(log.subjects.events_stream)
    assert json.loads(rejection.data)["data"]["code"] == code
    assert _work(log) == []


async def test_a_request_with_nobody_to_answer_is_a_dead_letter(log):
    with pytest.raises(UnparseableCommand):
        await _handlers(log).run({"run_id": "r1", "agent_type": "Researcher"}, seq=1)
    with pytest.raises(UnparseableCommand, match="not JSON"):
        await _handlers(log).run(b"{", seq=2)
    assert log.messages(log.subjects.events_stream) == []


async def test_cancel_records_the_request_once_and_signals_the_runner(log):
    handlers = _handlers(log)
    await handlers.run(_run(), seq=1)
    await log.append(RunEvents("r1", PARENT, id_prefix="runner").running(),
                     expected_last_seq=None)
    command = {"run_id": "r1", "parent": msgspec.to_builtins(PARENT)}

    assert await handlers.cancel(command, seq=2) == "running"
    assert await handlers.cancel(command, seq=3) == "running"

    assert _types(log) == ["r1:run.requested", "r1:run.running", "r1:run.cancel_requested"]
    [signal] = log.nats.published
    assert signal.subject == log.subjects.cancel_signal("Researcher")
    assert CancelSignal.model_validate_json(signal.data).run_id == "r1"


async def test_cancel_of_a_run_no_runner_started_aborts_it_at_once(log):
    """No child is there to stop, and no runner may ever come: the awaiting caller gets
    `aborted` now, and its cap slot is free (the cap counts open runs)."""
    handlers = _handlers(log)
    await handlers.run(_run(), seq=1)
    command = {"run_id": "r1", "parent": msgspec.to_builtins(PARENT)}

    assert await handlers.cancel(command, seq=2) == "aborted"
    assert await handlers.cancel(command, seq=3) == "aborted"

    assert _types(log) == ["r1:run.requested", "r1:run.cancel_requested", "r1:run.aborted"]
    [signal] = log.nats.published  # a runner that has just taken its item stops too
    assert CancelSignal.model_validate_json(signal.data).run_id == "r1"


async def test_cancel_of_a_finished_run_appends_nothing(log):
    run = RunEvents("r1", PARENT)
    await log.append_batch([run.requested(), run.started(), run.running(), run.completed()],
                           expected_last_seq=0)

    assert await _handlers(log).cancel({"run_id": "r1", "parent": msgspec.to_builtins(PARENT)},
                                       seq=9) == "completed"
    assert len(log.messages(log.subjects.events_stream)) == 4
    assert log.nats.published == []


async def test_clear_keeps_only_the_tombstone_of_the_runs_it_matched(log):
    done, running = RunEvents("done", PARENT), RunEvents("running", PARENT)
    await log.append_batch([done.requested(), done.started(), done.running(), done.completed()],
                           expected_last_seq=0)
    await log.append_batch([running.requested(), running.started(), running.running()],
                           expected_last_seq=0)

    cleared = await _handlers(log).clear({"parent": msgspec.to_builtins(PARENT),
                                          "status": ["completed"]}, seq=5)

    assert cleared == ["done"]
    assert _types(log, "done") == ["done:run.cleared"]
    assert (await log.read_run(PARENT, "done")).state is None
    assert _types(log, "running") == ["running:run.requested", "running:run.started",
                                      "running:run.running"]


async def test_a_clear_handled_late_takes_no_run_requested_after_it(log):
    """The clear was stored at sequence 5, while no parent ran; the run command stored at
    6 was handled first. The clear takes the run requested before it only."""
    handlers = _handlers(log)
    await handlers.run(_run("before"), seq=4)
    await handlers.run(_run("after"), seq=6)

    cleared = await handlers.clear({"parent": msgspec.to_builtins(PARENT)}, seq=5)

    assert cleared == ["before"]
    assert (await log.read_run(PARENT, "before")).state is None
    assert (await log.read_run(PARENT, "after")).state.requested_by_command == 6


async def test_a_cleared_run_id_can_be_requested_again(log):
    handlers = _handlers(log)
    await handlers.run(_run(), seq=1)
    await handlers.clear({"parent": msgspec.to_builtins(PARENT)}, seq=2)

    outcome = await handlers.run(_run(), seq=3)

    assert outcome.decision == "created"
    assert _types(log)[-1] == "r1:run.requested"
    assert (await log.read_run(PARENT, "r1")).state.status == "starting"


async def test_an_expired_run_request_is_refused_expired_and_leaves_the_run_id_free(log):
    handlers = _handlers(log)
    outcome = await handlers.run(_run(expires_in_ms=60_000), seq=1, overdue=5_000)

    assert (outcome.decision, outcome.code) == ("rejected", "expired")
    [rejected] = log.messages(log.subjects.events_stream, log.subjects.run_events(PARENT, "r1"))
    assert "65.0s" in json.loads(rejected.data)["data"]["error"]
    assert _work(log) == []
    assert (await handlers.run(_run(), seq=2)).decision == "created"


async def test_an_expired_request_of_an_interrupted_run_does_not_reattach_it(log):
    run = RunEvents("r1", PARENT)
    await log.append_batch([run.requested(), run.started(), run.running(),
                            run.interrupted()], expected_last_seq=0)

    outcome = await _handlers(log).run(_run(expires_in_ms=1_000), seq=9, overdue=1)

    assert (outcome.decision, outcome.status) == ("expired", "interrupted")
    assert _types(log)[-1] == "r1:run.interrupted"
    assert _work(log) == []


async def test_a_request_of_a_run_given_up_with_a_cancel_does_not_reattach_it(log):
    """Its cancel stays in its log: a re-attached child would be stopped at once, and
    the run sealed again later, for every retry."""
    run = RunEvents("r1", PARENT)
    await log.append_batch([run.requested(), run.started(), run.running(),
                            run.make(RunCancelRequested, reason="give-up"),
                            run.interrupted("budget-exceeded")], expected_last_seq=0)

    outcome = await _handlers(log).run(_run(), seq=9)

    assert (outcome.decision, outcome.status) == ("existing", "interrupted")
    assert _types(log)[-1] == "r1:run.interrupted"
    assert _work(log) == []
