"""The child-runner's decisions for one work item, against the in-memory event log:
whether it starts the run, what it records, and what it does with the item.
tests/integration/test_child_runner.py runs the runner against a real server."""

import asyncio
import json
import time
from typing import ClassVar

import pytest
from pydantic import BaseModel

from tether.adapters.holds import Hold
from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.execution import Execution
from tether.child.work import RunnerEnvironment
from tether.config import Settings
from tether.contract.messages import WorkItem, work_item_json
from tether.domain import decide, recovery_decisions
from tether.domain.events import ParentRef
from tether.testing import InMemoryEventLog, RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


class WorkMessage:
    """A work item's delivery: its reply subject says where it stands, as JetStream's does."""

    def __init__(self, item: WorkItem, *, stream_seq: int = 1, delivered: int = 1) -> None:
        self.subject = f"tether.work.{item.agent_type}"
        self.data = work_item_json(item)
        self.reply = f"$JS.ACK.TETHER_WORK.runners.{delivered}.{stream_seq}.{stream_seq}.0.0"
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def in_progress(self) -> None:
        self.settled.append("in_progress")


class Query(BaseModel):
    query: str


class Researcher(ChildAgent):
    input_model = Query

    async def run(self, ctx, input: Query):
        await ctx.report_progress(0.5, milestone="halfway")
        await ctx.output("found it")
        return "summary of " + input.query


class Broken(ChildAgent):
    agent_type = "Researcher"

    async def run(self, ctx, input):
        raise RuntimeError("the child broke")


class Asking(ChildAgent):
    agent_type = "Researcher"

    async def run(self, ctx, input):
        return AwaitingInput(key="approve-1", reason="waiting_for_human",
                             pending=[{"kind": "human_input", "prompt": "go on?"}])


@pytest.fixture
def log() -> InMemoryEventLog:
    return InMemoryEventLog()


def _env(log: InMemoryEventLog, **settings) -> RunnerEnvironment:
    return RunnerEnvironment(log=log, settings=Settings(**settings), runner_id="runner-1",
                             cancel_grace_s=0.05)


def _types(log: InMemoryEventLog, run_id: str = "r1") -> list[str]:
    return [json.loads(m.data)["type"] for m in log.messages(
        log.subjects.events_stream, log.subjects.run_events(PARENT, run_id))]


async def _requested(log: InMemoryEventLog, run: RunEvents) -> WorkItem:
    """A run requested as the parent does it, and its first work item."""
    requested = run.requested(input={"query": "HTTP/3"})
    _, seq = await log.append_new(requested)
    return WorkItem(run_id=run.run_id, parent=run.parent, agent_type="Researcher",
                    requested=requested, requested_seq=seq, attempt=0)


async def test_a_new_run_is_started_without_a_read_recorded_and_acknowledged(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    msg = WorkMessage(item)

    outcome = await Execution(_env(log), Researcher, msg, item).run()

    assert (outcome.kind, outcome.attempt) == ("completed", 1)
    assert _types(log) == ["run.requested", "run.running", "run.milestone", "run.output",
                           "run.completed"]
    state = (await log.read_run(PARENT, "r1")).state
    assert (state.summary, state.output_text) == ("summary of HTTP/3", "found it")
    assert msg.settled == ["ack"]
    assert [m.subject for m in log.nats.published] == [log.subjects.run_progress(PARENT, "r1")]


async def test_an_item_whose_run_moved_since_it_was_published_reads_the_run(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    await log.append(run.completed("done elsewhere"), expected_last_seq=1)

    outcome = await Execution(_env(log), Researcher, WorkMessage(item), item).run()

    assert (outcome.kind, outcome.detail) == ("skipped", "the run already ended completed")
    assert _types(log) == ["run.requested", "run.completed"]


async def test_a_second_item_for_one_dispatch_leaves_the_run_to_the_first(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    first = Execution(_env(log), Researcher, WorkMessage(item), item)
    assert (await first.run()).kind == "completed"

    # Published before the run's first attempt; delivered first after it finished.
    outcome = await Execution(_env(log), Researcher, WorkMessage(item, stream_seq=2),
                              item).run()

    assert outcome.kind == "skipped"
    assert _types(log).count("run.running") == 1


async def test_a_redelivered_item_takes_the_run_over_from_a_runner_that_died(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    await log.append(run.running(attempt=1), expected_last_seq=1)

    outcome = await Execution(_env(log), Researcher, WorkMessage(item, delivered=2),
                              item).run()

    assert (outcome.kind, outcome.attempt) == ("completed", 2)
    assert (await log.read_run(PARENT, "r1")).state.attempt == 2


@pytest.mark.parametrize(("decision", "kind"), [
    # The request alone: a tree's cancel marks every run before it stops any, and an
    # earlier version's cancel of a run not started left only this. The runner aborts it.
    (decide.request_cancel, "aborted"),
    # A cancel aborts a run no runner has started at once: its work item finds it ended.
    (decide.cancel, "skipped"),
], ids=["asked", "cancelled"])
async def test_a_run_cancelled_before_it_started_ends_aborted_without_starting_the_child(
        log, decision, kind):
    item = await _requested(log, RunEvents("r1", PARENT))
    await log.update(PARENT, "r1", lambda s: decision(s, decide.Cause(1, 5_000)))

    outcome = await Execution(_env(log), Researcher, WorkMessage(item), item).run()

    assert outcome.kind == kind
    assert _types(log) == ["run.requested", "run.cancel_requested", "run.aborted"]


class Untyped(ChildAgent):
    """A child that declares no input model."""

    agent_type = "Researcher"
    seen: ClassVar[list] = []

    async def run(self, ctx, input):
        Untyped.seen.append((input.query, input.model_dump()))
        return "read"


async def test_a_child_without_an_input_model_gets_the_input_as_attributes_and_a_dict(log):
    item = await _requested(log, RunEvents("r1", PARENT))

    outcome = await Execution(_env(log), Untyped, WorkMessage(item), item).run()

    assert outcome.kind == "completed"
    assert Untyped.seen == [("HTTP/3", {"query": "HTTP/3"})]


async def test_a_child_that_raises_fails_the_run_with_its_error_only(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    msg = WorkMessage(item)

    outcome = await Execution(_env(log), Broken, msg, item).run()

    assert outcome.kind == "failed"
    assert isinstance(outcome.exception, RuntimeError)
    state = (await log.read_run(PARENT, "r1")).state
    assert (state.status, state.error) == ("error", "RuntimeError: the child broke")
    assert msg.settled == ["ack"]


class Verbose(ChildAgent):
    agent_type = "Researcher"

    async def run(self, ctx, input):
        return {"text": "x" * 2_000}


async def test_a_result_larger_than_the_log_takes_fails_the_run_and_says_how_large(log):
    log.nats.max_payload = 1_000
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    msg = WorkMessage(item)

    outcome = await Execution(_env(log), Verbose, msg, item).run()

    assert outcome.kind == "failed"
    assert _types(log) == ["run.requested", "run.running", "run.failed"]
    state = (await log.read_run(PARENT, "r1")).state
    size = int(state.error.removeprefix("the child's result is ").split(" ")[0])
    assert size > 2_000
    assert state.error == (f"the child's result is {size} bytes; the largest event NATS "
                           f"accepts is 1000 bytes")
    assert msg.settled == ["ack"]


async def test_a_run_whose_runners_kept_dying_fails_after_max_attempts(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    for attempt in (1, 2):
        await log.update(PARENT, "r1", lambda s, a=attempt: [run.running(attempt=a)])

    outcome = await Execution(_env(log, max_attempts=2), Researcher,
                              WorkMessage(item, delivered=3), item).run()

    assert outcome.kind == "failed"
    assert outcome.detail.startswith("gave up after 2 attempts")
    assert _types(log)[-1] == "run.failed"


async def test_a_child_that_waits_for_input_pauses_the_run_once(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)

    outcome = await Execution(_env(log), Asking, WorkMessage(item), item).run()

    assert outcome.kind == "paused"
    state = (await log.read_run(PARENT, "r1")).state
    assert state.paused is not None and state.paused.reason == "waiting_for_human"
    # A stale copy of the item finds the run paused: nothing is appended twice.
    again = await Execution(_env(log), Asking, WorkMessage(item, delivered=2), item).run()
    assert again.kind == "skipped"
    assert _types(log).count("run.paused") == 1
    assert _types(log).count("run.milestone") == 1


# --- a runner stopped (paused) past its hold on the item -------------------------------


class Waiting(ChildAgent):
    """Reports a milestone, waits for the test, then reports again and returns."""

    agent_type = "Researcher"
    started = 0
    go_on: "asyncio.Event"
    reached: "asyncio.Event"

    async def run(self, ctx, input):
        Waiting.started += 1
        await ctx.report_progress(0.1, milestone="first")
        Waiting.reached.set()
        await Waiting.go_on.wait()
        await ctx.report_progress(0.9, milestone="second")
        return "done late"


@pytest.fixture
def waiting():
    Waiting.started, Waiting.go_on, Waiting.reached = 0, asyncio.Event(), asyncio.Event()
    return Waiting


async def test_an_item_held_past_its_ack_wait_starts_nothing_and_is_left_to_redelivery(
        log, waiting):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    msg = WorkMessage(item)
    # The fetch that brought it was sent 20 s ago (the runner was stopped since): the
    # server may have handed the item to another runner already.
    hold = Hold(time.monotonic() - 20, ack_wait_s=10)

    outcome = await Execution(_env(log), Waiting, msg, item, hold).run()

    assert outcome.kind == "superseded"
    assert "left to its redelivery" in outcome.detail
    assert _types(log) == ["run.requested"]
    assert (waiting.started, msg.settled) == (0, [])


async def test_a_paused_attempt_taken_over_reports_and_records_nothing_after_it_wakes(
        log, waiting):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    msg = WorkMessage(item)
    hold = Hold(time.monotonic(), ack_wait_s=10)
    execution = Execution(_env(log, work_ack_wait_ms=10_000), Waiting, msg, item, hold)
    running = asyncio.ensure_future(execution.run())
    await waiting.reached.wait()

    # Paused 15 s: the item went to another runner, whose attempt 2 took the run and
    # completed it (its ids are its own).
    hold.renewed_at -= 15
    await log.append(RunEvents("r1", PARENT, id_prefix="other").running(attempt=2),
                     expected_last_seq=None)
    await log.append(run.completed("by attempt 2"), expected_last_seq=None)
    published = len(log.nats.published)
    waiting.go_on.set()
    outcome = await running

    assert (outcome.kind, outcome.attempt) == ("superseded", 1)
    assert "attempt 2 took over the run" in outcome.detail
    assert _types(log) == ["run.requested", "run.running", "run.milestone", "run.running",
                           "run.completed"]
    assert len(log.nats.published) == published, "no progress signal after the takeover"
    assert "ack" not in msg.settled  # the item is attempt 2's


async def test_an_outcome_decided_by_another_runner_is_never_taken_for_ones_own(log, waiting):
    """Two runners finish the same attempt number from the same history: each outcome's
    id names its execution, so the loser finds its append refused instead of finding the
    winner's event under its own id and reporting it as recorded."""
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    waiting.go_on.set()
    first = await Execution(_env(log), Waiting, WorkMessage(item), item).run()
    assert first.kind == "completed"

    # The same item, delivered again to a runner that read the run before it ended.
    second = Execution(_env(log), Waiting, WorkMessage(item, delivered=2), item)
    second.attempt, second._incarnation = 1, (await log.read_run(PARENT, "r1")).state.incarnation
    state, ended = await second._end(run.completed("again"))

    assert not ended and state.status == "completed"
    assert _types(log).count("run.completed") == 1


class ReturnsAfterGiveUp(ChildAgent):
    agent_type = "Researcher"

    async def run(self, ctx, input):
        await ctx.report_progress(0.1, milestone="first")
        Waiting.reached.set()
        await ctx.cancelled.wait()
        return "finished anyway"


async def test_a_result_returned_after_a_give_up_repairs_the_interruption(log, waiting):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    execution = Execution(_env(log), ReturnsAfterGiveUp, WorkMessage(item), item)
    running = asyncio.ensure_future(execution.run())
    await waiting.reached.wait()
    state = (await log.read_run(PARENT, "r1")).state
    await log.update(PARENT, "r1", lambda s: recovery_decisions.give_up(
        s, decide.Cause(7, 9_000, origin="rec"), "no-progress", "silent",
        child_still_running=True))
    execution.cancel(decide.GIVE_UP)

    outcome = await running

    assert outcome.kind == "completed"
    assert _types(log)[-3:] == ["run.cancel_requested", "run.interrupted", "run.completed"]
    final = (await log.read_run(PARENT, "r1")).state
    assert (final.status, final.summary) == ("completed", "finished anyway")
    assert state.attempt == final.attempt == 1
