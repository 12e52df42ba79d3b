"""The child-runner's decisions for one work item, against the in-memory event log:
whether it starts the run, what it records, and what it does with the item.
tests/integration/test_child_runner.py runs the runner against a real server."""

import json

import pytest
from pydantic import BaseModel

from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.execution import Execution
from tether.child.work import RunnerEnvironment
from tether.config import Settings
from tether.contract.messages import WorkItem, work_item_json
from tether.domain import decide
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


async def test_a_run_cancelled_before_it_started_is_aborted_without_starting_the_child(log):
    run = RunEvents("r1", PARENT)
    item = await _requested(log, run)
    await log.update(PARENT, "r1", lambda s: decide.cancel(s, decide.Cause(1, 5_000)))

    outcome = await Execution(_env(log), Researcher, WorkMessage(item), item).run()

    assert outcome.kind == "aborted"
    assert _types(log) == ["run.requested", "run.cancel_requested", "run.aborted"]


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
