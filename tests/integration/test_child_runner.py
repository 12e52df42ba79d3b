"""The child-runner in-process against a real NATS: work items in, run events out.

Each test appends `run.requested` itself and publishes the work item (the parent service
is not under test), then awaits the run's events with `EventLog.follow`, so nothing here
sleeps to wait for the runner.
"""

import asyncio
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest
import structlog
from eventually import eventually
from pydantic import BaseModel
from stream_messages import next_messages

from examples.agents import Extractor, Failing, Researcher, ResearchInput, Sleeper
from tether.adapters.event_log import EventLog
from tether.agent_registry import AgentRegistry
from tether.child import context as context_module
from tether.child.agent import ChildAgent
from tether.child.context import RunContext, report_progress
from tether.child.runner import MAX_DELIVER_MARGIN, ChildRunner, consumer_name
from tether.child.work import Outcome
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    CancelSignal,
    ChatMessage,
    HookMessage,
    ProgressSignal,
    WorkItem,
    work_item_json,
)
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import Event, ParentRef, RunCancelRequested
from tether.domain.ids import finish_message_id, work_message_id
from tether.ports import SYSTEM_CLOCK, RunHistory
from tether.testing import RunEvents
from tether_services.child_runner import open_runner

PARENT = ParentRef(agent="Assistant", name="user-42")
TERMINAL = {"run.completed", "run.failed", "run.aborted"}


@dataclass
class RunningRunner:
    runner: ChildRunner
    stop: asyncio.Event
    task: asyncio.Task
    outcomes: asyncio.Queue[Outcome] = field(default_factory=asyncio.Queue)

    async def stopped(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, timeout=10)


@pytest.fixture
async def start_runner(nc, log, settings):
    started: list[RunningRunner] = []

    async def start(*agents: type[ChildAgent], **options: Any) -> RunningRunner:
        overrides = {"work_ack_wait_ms": 1000, **options.pop("settings", {})}
        if "cancel_grace_ms" not in overrides:  # else the runner takes the setting's
            options.setdefault("cancel_grace_s", 0.2)
        outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        runner = await open_runner(nc, settings.model_copy(update=overrides), AgentRegistry(agents),
                             on_outcome=outcomes.put_nowait, fetch_timeout_s=0.3, **options)
        stop = asyncio.Event()
        running = RunningRunner(runner, stop, asyncio.create_task(runner.run(stop)), outcomes)
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stopped()


async def dispatch(log: EventLog, agent_type: str, input: dict[str, Any],
                   recorded: Callable[[RunEvents], list[Event]] | None = None) -> RunEvents:
    """A new run and its work item as the parent publishes them (with the request); with
    `recorded`, a run that has those events after its request, and an item that only
    names it, as the runner treats a redelivered one: the log decides."""
    run = RunEvents(f"r-{uuid.uuid4().hex[:8]}", PARENT)
    requested = run.requested(agent_type, input=input)
    seq = await log.append_batch([requested, *(recorded(run) if recorded else [])],
                                 expected_last_seq=0)
    if recorded:
        item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type=agent_type)
    else:
        item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type=agent_type, attempt=0,
                        requested=requested, requested_seq=seq)
    await publish_item(log, item)
    return run


async def publish_item(log: EventLog, item: WorkItem, msg_id: str | None = None) -> None:
    await log.jetstream.publish(
        log.subjects.work(item.agent_type), work_item_json(item),
        headers={"Nats-Msg-Id": msg_id or work_message_id(item.run_id, 1)},
        stream=log.subjects.work_stream)


async def event_of(log: EventLog, run: RunEvents, wanted: Callable[[Event], bool],
                   timeout: float = 10) -> Event:
    """The first event of the run (replayed or live) that `wanted` accepts."""
    subject = log.subjects.run_events(run.parent, run.run_id)
    async with asyncio.timeout(timeout), aclosing(log.follow(subject)) as stream:
        async for stored in stream:
            if stored.event is not None and wanted(stored.event):
                return stored.event
    raise AssertionError("unreachable")


async def finished(log: EventLog, run: RunEvents, timeout: float = 10) -> RunHistory:
    await event_of(log, run, lambda e: e.type in TERMINAL, timeout)
    return await log.read_run(run.parent, run.run_id)


def of_type(history: RunHistory, event_type: str) -> list[Event]:
    return [e for e in history.events if e.type == event_type]


async def last_progress_signal(log: EventLog, run: RunEvents) -> ProgressSignal:
    message = await log.jetstream.get_last_msg(log.subjects.progress_stream,
                                               log.subjects.run_progress(run.parent, run.run_id))
    return ProgressSignal.model_validate_json(message.data)


# --- outcomes ------------------------------------------------------------------------


async def test_a_researcher_completes_with_summary_output_milestone_and_progress(
        log, start_runner, settings):
    # A snapshot of every signal sent (persist window 0), so the log shows the coalescing.
    runner = await start_runner(Researcher, settings={"progress_persist_ms": 0})
    run = await dispatch(log, "Researcher", {"query": "HTTP/3"})
    history = await finished(log, run)
    state = history.state

    assert state.status == "completed"
    assert state.summary == "HTTP/3: the two sources agree on the essentials."
    assert state.output is None
    assert state.output_text == ("Searching the web for 'HTTP/3'.\n"
                                 "Two sources agree; writing the summary.\n")
    [running] = of_type(history, "run.running")
    assert (running.data.attempt, running.data.runner_id) == (1, runner.runner.runner_id)
    [milestone] = of_type(history, "run.milestone")
    assert (milestone.data.sequence, milestone.data.name, milestone.data.data) == (
        0, "sources-gathered", {"sources": 2})
    assert milestone.event_id == state.event_id("ms", 0) == f"{run.run_id}:{state.incarnation}:ms:0"
    # 0.1 goes at once, 0.5 waits in its window until the milestone, a later value,
    # supersedes it; 1.0 is final.
    assert [e.data.fraction for e in of_type(history, "run.progress_persisted")] == [0.1, 1.0]
    assert history.events[-1].type == "run.completed"
    # The outcome's id names the execution that decided it (another runner that decides
    # the same from the same history never takes this event for its own).
    assert history.events[-1].event_id.startswith(state.event_id("completed") + ":")
    assert history.events[-1].event_id.split(":")[-1] in running.event_id
    assert (await last_progress_signal(log, run)).fraction == 1.0
    outcome = await runner.outcomes.get()
    assert (outcome.kind, outcome.attempt) == ("completed", 1)


async def test_a_workflow_child_completes_with_its_own_output_and_summary(log, start_runner):
    await start_runner(Extractor)
    run = await dispatch(log, "Extractor", {"text": "name: Ada\nborn: 1815\nno colon here"})
    state = (await finished(log, run)).state
    assert state.status == "completed"
    assert state.summary == "Extraction complete"
    assert state.output == {"rows": [{"key": "name", "value": "Ada"},
                                     {"key": "born", "value": "1815"}]}


async def test_a_child_that_raises_fails_with_a_safe_message(log, start_runner):
    await start_runner(Failing)
    plain = await dispatch(log, "Failing", {})
    long = await dispatch(log, "Failing", {"message": "x" * 2000})
    state = (await finished(log, plain)).state
    assert (state.status, state.error) == ("error", "ValueError: the child failed on purpose")
    error = (await finished(log, long)).state.error
    assert error.startswith("ValueError: xxx") and len(error) <= 500
    assert "Traceback" not in error


class OversizedInput(BaseModel):
    size: int


class Oversized(ChildAgent):
    description = "Returns an output of the size it is asked for"
    input_model = OversizedInput

    async def run(self, ctx: RunContext, input: OversizedInput) -> dict[str, str]:
        return {"blob": "x" * input.size}


async def test_a_result_larger_than_the_server_takes_fails_the_run_and_says_so(
        log, nc, start_runner):
    await start_runner(Oversized)
    limit = nc.max_payload
    run = await dispatch(log, "Oversized", {"size": limit})
    state = (await finished(log, run)).state

    assert state.status == "error"
    size = int(state.error.removeprefix("the child's result is ").split(" ")[0])
    assert size > limit
    assert state.error == (f"the child's result is {size} bytes; the largest event NATS "
                           f"accepts is {limit} bytes")
    fitting = await dispatch(log, "Oversized", {"size": 1000})
    assert (await finished(log, fitting)).state.status == "completed"


class OversizedMilestone(ChildAgent):
    description = "Reports a milestone whose data is of the size it is asked for"
    input_model = OversizedInput

    async def run(self, ctx: RunContext, input: OversizedInput) -> str:
        await ctx.report_progress(milestone="drafted", data={"blob": "x" * input.size})
        return "reported"


async def test_a_milestone_larger_than_the_server_takes_fails_the_child_and_says_so(
        log, nc, start_runner):
    """No retry can append it: the child's report raises at once, not a broker error the
    runner would retry for ever."""
    await start_runner(OversizedMilestone)
    limit = nc.max_payload
    run = await dispatch(log, "OversizedMilestone", {"size": limit})
    history = await finished(log, run)

    assert history.state.status == "error"
    assert history.state.milestones == ()
    prefix = "EventTooLarge: a run.milestone event of "
    assert history.state.error.startswith(prefix)
    size = int(history.state.error.removeprefix(prefix).split(" ")[0])
    assert size > limit
    assert history.state.error == (f"{prefix}{size} bytes is larger than the {limit} bytes "
                                   f"NATS accepts in one message")
    fitting = await dispatch(log, "OversizedMilestone", {"size": 1000})
    assert [m.name for m in (await finished(log, fitting)).state.milestones] == ["drafted"]


async def test_invalid_input_fails_the_run_with_the_validation_error(log, start_runner):
    await start_runner(Researcher)
    run = await dispatch(log, "Researcher", {"query": "ab"})
    history = await finished(log, run)
    assert history.state.status == "error"
    assert history.state.error == ("invalid input for Researcher: query: String should have at "
                                   "least 3 characters")
    assert len(of_type(history, "run.running")) == 1


# --- deliveries ----------------------------------------------------------------------


async def detached_dispatch(log: EventLog, options: DetachedOptions,
                            recorded: Callable[[RunEvents], list[Event]] | None = None
                            ) -> RunEvents:
    """`dispatch` of a detached Researcher run whose parent registered `on_done`."""
    registry = await log.jetstream.key_value(log.subjects.registry_bucket)
    await registry.put(f"hook.{PARENT.agent}.on_done", b"{}")
    run = RunEvents(f"r-{uuid.uuid4().hex[:8]}", PARENT)
    requested = run.requested("Researcher", input={"query": "HTTP/3"}, detached=options)
    seq = await log.append_batch([requested, *(recorded(run) if recorded else [])],
                                 expected_last_seq=0)
    item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type="Researcher",
                    **({} if recorded else {"attempt": 0, "requested": requested,
                                            "requested_seq": seq}))
    await publish_item(log, item)
    return run


async def test_the_runner_delivers_the_hook_and_milestone_notice_of_what_it_records(
        log, start_runner):
    await start_runner(Researcher)
    options = DetachedOptions(on_finish="on_done", on_milestones=["sources-gathered"])
    run = await detached_dispatch(log, options)
    [message] = await next_messages(log, log.subjects.hook(PARENT.agent, "on_done"), 1)
    history = await log.read_run(PARENT, run.run_id)
    hook = HookMessage.model_validate_json(message.data)
    assert (hook.run.run_id, hook.result.status) == (run.run_id, "completed")
    assert hook.result.summary == history.state.summary
    assert message.headers["Nats-Msg-Id"] == finish_message_id(history.state, "completed",
                                                                "on_done")
    # Published right after the outcome it owes: the handler need not read the ledger.
    assert message.headers[FIRST_PUBLICATION_HEADER] == "1"
    [chat] = await next_messages(log, log.subjects.chat(PARENT), 1)
    notice = ChatMessage.model_validate_json(chat.data)
    assert (notice.metadata["kind"], notice.metadata["milestone"]) == (
        "milestone", "sources-gathered")
    # The notice is in the ledger, recorded before the run's outcome.
    types = [e.type for e in history.events]
    assert types.index("run.notified") < types.index("run.completed")
    assert set(history.state.ledger.notifications) == {"milestone:sources-gathered"}


async def test_a_work_item_of_a_run_that_ended_delivers_what_the_run_still_owes(
        log, start_runner):
    """A runner that died between its outcome's append and the hook: the item comes back,
    finds the run ended, and delivers the hook and the milestone notice it lacks."""
    await start_runner(Researcher)
    options = DetachedOptions(on_finish="on_done", on_milestones=["drafted"])
    run = await detached_dispatch(log, options, recorded=lambda run: [
        run.running(), run.milestone("drafted"), run.completed("done before")])
    [message] = await next_messages(log, log.subjects.hook(PARENT.agent, "on_done"), 1)
    hook = HookMessage.model_validate_json(message.data)
    assert (hook.run.run_id, hook.result.summary) == (run.run_id, "done before")
    assert FIRST_PUBLICATION_HEADER not in message.headers, "maybe not its first"
    [chat] = await next_messages(log, log.subjects.chat(PARENT), 1)
    assert ChatMessage.model_validate_json(chat.data).metadata["milestone"] == "drafted"
    await event_of(log, run, lambda e: e.type == "run.notified")


# --- progress ------------------------------------------------------------------------


class BurstInput(BaseModel):
    signals: int
    pause_s: float = 0.0
    final: bool = True


class Chatty(ChildAgent):
    input_model = BurstInput

    async def run(self, ctx: RunContext, input: BurstInput) -> dict[str, float]:
        started = time.monotonic()
        for i in range(1, input.signals + 1):
            await ctx.report_progress(fraction=i / (input.signals + 1), message=f"signal {i}")
            await asyncio.sleep(input.pause_s)
        elapsed = time.monotonic() - started
        if input.final:
            await ctx.report_progress(fraction=1.0, message="done")
        return {"elapsed_s": elapsed}


async def test_rapid_progress_is_coalesced_latest_value_kept_and_completion_sent(
        log, start_runner, settings):
    await start_runner(Chatty, settings={"progress_persist_ms": 0})
    run = await dispatch(log, "Chatty", {"signals": 60, "pause_s": 0.005})
    history = await finished(log, run)
    persisted = of_type(history, "run.progress_persisted")
    window_s = settings.progress_coalesce_ms / 1000
    elapsed_s = history.state.output["elapsed_s"]

    *coalesced, final = persisted
    # One at once, then at most one per window, in order; the final supersedes the value
    # still waiting for its window (test_the_end_supersedes_a_value_waiting_for_its_window).
    assert 2 <= len(coalesced) <= int(elapsed_s / window_s) + 2, (len(coalesced), elapsed_s)
    numbers = [int(e.data.message.removeprefix("signal ")) for e in coalesced]
    assert numbers[0] == 1 and numbers == sorted(set(numbers))
    assert (final.data.fraction, final.data.message) == (1.0, "done")
    assert history.events[-1].type == "run.completed"
    assert (await last_progress_signal(log, run)).message == "done"


class EndsAtOnce(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        # Back to back: 0.6 is still waiting for its window when the end comes.
        for fraction in (0.3, 0.6, 1.0):
            await ctx.report_progress(fraction=fraction, message=f"at {fraction}")
        return "done"


async def signals_of_a_run(log: EventLog, nc, agent_type: str
                           ) -> tuple[list[ProgressSignal], RunHistory]:
    """Every progress signal a subscriber gets from one run up to its final one
    (`fraction == 1`), and the run's history once it finished."""
    signals: list[ProgressSignal] = []
    ended = asyncio.Event()

    async def on_signal(msg) -> None:
        signals.append(signal := ProgressSignal.model_validate_json(msg.data))
        if signal.fraction == 1.0:
            ended.set()

    subscription = await nc.subscribe(f"{log.subjects.prefix}.progress.>", cb=on_signal)
    await nc.flush()
    run = await dispatch(log, agent_type, {})
    history = await finished(log, run)
    await asyncio.wait_for(ended.wait(), timeout=5)
    await subscription.unsubscribe()
    return signals, history


async def test_the_end_supersedes_a_value_waiting_for_its_window(log, start_runner, nc):
    await start_runner(EndsAtOnce, settings={"progress_persist_ms": 0})
    signals, history = await signals_of_a_run(log, nc, "EndsAtOnce")
    # The latest value wins: 0.3 went at once, 0.6 was superseded before its window ended.
    assert [(s.fraction, s.message) for s in signals] == [(0.3, "at 0.3"), (1.0, "at 1.0")]
    assert [e.data.fraction for e in of_type(history, "run.progress_persisted")] == [0.3, 1.0]
    assert history.state.progress.fraction == 1.0


class MilestoneAtOnce(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        # 0.6 is still waiting for its window when the milestone, a later value, comes.
        for fraction in (0.3, 0.6):
            await ctx.report_progress(fraction=fraction, message=f"at {fraction}")
        await ctx.report_progress(milestone="half", fraction=0.7, message="half-way")
        await ctx.report_progress(fraction=1.0, message="at 1.0")
        return "done"


async def test_a_milestone_supersedes_a_value_waiting_for_its_window(log, start_runner, nc):
    await start_runner(MilestoneAtOnce, settings={"progress_persist_ms": 0})
    signals, history = await signals_of_a_run(log, nc, "MilestoneAtOnce")
    assert [(s.fraction, s.message, s.milestone) for s in signals] == [
        (0.3, "at 0.3", None), (0.7, "half-way", "half"), (1.0, "at 1.0", None)]
    assert [e.data.fraction for e in of_type(history, "run.progress_persisted")] == [0.3, 1.0]
    assert [m.name for m in history.state.milestones] == ["half"]


async def test_a_pending_signal_is_flushed_before_the_outcome(log, start_runner):
    await start_runner(Chatty)  # the default persist window: signal 20 waits in it
    run = await dispatch(log, "Chatty", {"signals": 20, "final": False})
    history = await finished(log, run)
    persisted = of_type(history, "run.progress_persisted")
    # The first window starts with the attempt: a run shorter than it writes one snapshot.
    assert [e.data.message for e in persisted] == ["signal 20"]
    assert history.events.index(persisted[-1]) < history.events.index(history.events[-1])
    assert history.state.progress.message == "signal 20"


async def test_snapshots_reach_the_log_at_most_once_per_persist_window(log, start_runner):
    await start_runner(Chatty, settings={"progress_coalesce_ms": 10, "progress_persist_ms": 100})
    run = await dispatch(log, "Chatty", {"signals": 60, "pause_s": 0.005})
    history = await finished(log, run)
    persisted = of_type(history, "run.progress_persisted")
    elapsed_s = history.state.output["elapsed_s"]
    *windowed, final = persisted
    # At most one per 100 ms window from the attempt's start, then the final at once.
    assert 1 <= len(windowed) <= int(elapsed_s / 0.1) + 1, (len(windowed), elapsed_s)
    # The first window starts with the attempt: a signal in it waits for the window's end
    # (a first signal reported only after a whole window, on a stalled machine, need not).
    running = of_type(history, "run.running")[-1]
    first = windowed[0]
    assert first.data.message != "signal 1" or first.occurred_at - running.occurred_at >= 100
    assert (final.data.fraction, final.data.message) == (1.0, "done")
    assert len(persisted) < 30, "far fewer snapshots than the signals sent every 10 ms"
    assert (await last_progress_signal(log, run)).message == "done"


class Holding(ChildAgent):
    """Reports twice, then waits until the test has seen what it needs in the log."""

    release: asyncio.Event

    async def run(self, ctx: RunContext, input: Any) -> str:
        await ctx.report_progress(fraction=0.1, message="first")
        await ctx.report_progress(fraction=0.2, message="second")
        await asyncio.wait_for(type(self).release.wait(), 10)
        return "released"


async def logged_at(log, event) -> int:
    """When the stream stored `event`, on the broker's clock."""
    stored = await log.read_subject(log.subjects.run_events(event.parent, event.run_id))
    [at] = [s.logged_at for s in stored if s.event.event_id == event.event_id]
    return at


async def test_a_quiet_child_s_last_signal_reaches_the_log_within_the_window(
        log, start_runner):
    Holding.release = asyncio.Event()
    # A detached run with a 400 ms no-progress budget: the 60 s persist window is capped
    # at a quarter of it, so the reconciler sees the child's last signal in time.
    await start_runner(Holding, settings={"progress_coalesce_ms": 0, "progress_persist_ms": 60_000})
    run = RunEvents(f"r-{uuid.uuid4().hex[:8]}", PARENT)
    await log.append_batch([run.requested("Holding", input={}, detached={"on_finish": None},
                                          max_budget_ms=60_000, no_progress_budget_ms=400),
                            run.started()], expected_last_seq=0)
    item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type="Holding")
    await log.jetstream.publish(log.subjects.work("Holding"), work_item_json(item),
                                stream=log.subjects.work_stream)
    second = await event_of(log, run, lambda e: e.type == "run.progress_persisted")
    assert second.data.message == "second", "the latest signal of the first window"
    state = (await log.read_run(run.parent, run.run_id)).state
    assert state.status == "running", "persisted by its window, not by the run's end"
    # The deadline counts from when the stream stored the snapshot (the broker's clock).
    assert state.progress.message == "second" and state.progress.at == second.occurred_at
    assert state.last_signal_at == await logged_at(log, second)
    Holding.release.set()
    history = await finished(log, run)
    assert [e.data.message for e in of_type(history, "run.progress_persisted")] == ["second"]


class FinishingInput(BaseModel):
    after: bool = False


class Finishing(ChildAgent):
    """Ends its progress at 1.0, then marks a milestone; with `after`, reports once more."""

    input_model = FinishingInput

    async def run(self, ctx: RunContext, input: FinishingInput) -> str:
        await ctx.report_progress(fraction=0.5, message="half")
        await ctx.report_progress(fraction=1.0, message="all rows")
        await ctx.report_progress(milestone="imported", message="imported", data={"rows": 9})
        if input.after:
            await ctx.report_progress(fraction=0.2, message="cleaning up")
        return "ok"


async def test_a_milestone_supersedes_the_snapshot_still_waiting_for_its_window(
        log, start_runner):
    await start_runner(Finishing)  # the default persist window: nothing is due yet
    run = await dispatch(log, "Finishing", {})
    history = await finished(log, run)
    assert of_type(history, "run.progress_persisted") == []
    [milestone] = of_type(history, "run.milestone")
    progress = history.state.progress
    assert (progress.milestone, progress.message, progress.at) == (
        "imported", "imported", milestone.occurred_at)
    assert history.state.last_signal_at == await logged_at(log, milestone)
    # Live subscribers still saw every signal, the milestone last.
    signal = await last_progress_signal(log, run)
    assert (signal.milestone, signal.at) == ("imported", milestone.occurred_at)

    # A signal after the milestone is newer than it: its snapshot goes in before the outcome.
    run = await dispatch(log, "Finishing", {"after": True})
    history = await finished(log, run)
    [snapshot] = of_type(history, "run.progress_persisted")
    assert (snapshot.data.fraction, snapshot.data.message) == (0.2, "cleaning up")
    assert [e.type for e in history.events[-3:]] == [
        "run.milestone", "run.progress_persisted", "run.completed"]
    assert history.state.progress.message == "cleaning up"


class Persisting(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        await ctx.report_progress(fraction=0.2, data={"rows": 5}, persist=True)
        await ctx.report_progress(fraction=0.4, data={"secret": "live only"})
        return "ok"


async def test_progress_data_is_persisted_only_when_asked(log, start_runner):
    """Data not asked to persist is live only: live subscribers get it, the log's
    snapshot leaves it out, and the progress stream lets it go at once (late
    subscribers never replay it)."""
    live: list[ProgressSignal] = []

    async def heard(msg) -> None:
        live.append(ProgressSignal.model_validate_json(msg.data))

    subscription = await log.nats.subscribe(
        log.subjects.live(f"{log.subjects.prefix}.progress.>"), cb=heard)
    try:
        await start_runner(Persisting)
        run = await dispatch(log, "Persisting", {})
        history = await finished(log, run)
        kept, live_only = of_type(history, "run.progress_persisted")
        assert (kept.data.fraction, kept.data.data) == (0.2, {"rows": 5})
        assert (live_only.data.fraction, live_only.data.data) == (0.4, None)
        await eventually(lambda: len(live) >= 2, timeout=5)
        assert [(s.fraction, s.data) for s in live] == [(0.2, {"rows": 5}),
                                                         (0.4, {"secret": "live only"})]

        async def let_go() -> bool:
            try:
                await last_progress_signal(log, run)
            except nats.js.errors.NotFoundError:
                return True
            return False

        await eventually(let_go, timeout=10)
    finally:
        await subscription.unsubscribe()



async def test_milestones_are_sequenced_from_zero(log, start_runner):
    await start_runner(Sleeper)
    run = await dispatch(log, "Sleeper", {"seconds": 0.06, "milestones": 3})
    history = await finished(log, run)
    assert [(e.data.sequence, e.data.name, e.data.data) for e in of_type(history, "run.milestone")] \
        == [(0, "step-1", {"step": 1}), (1, "step-2", {"step": 2}), (2, "step-3", {"step": 3})]
    assert [m.sequence for m in history.state.milestones] == [0, 1, 2]


async def test_a_resumed_run_keeps_what_was_recorded_and_does_not_repeat_it(log, start_runner):
    await start_runner(Researcher)

    def first_attempt(run: RunEvents) -> list[Event]:
        return [run.running(attempt=1), run.output("Searching the web for 'HTTP/3'.\n"),
                run.milestone("sources-gathered", {"sources": 2})]

    run = await dispatch(log, "Researcher", {"query": "HTTP/3"}, first_attempt)
    history = await finished(log, run)
    assert [e.data.attempt for e in of_type(history, "run.running")] == [1, 2]
    assert [(e.data.sequence, e.data.name) for e in of_type(history, "run.milestone")] == [
        (0, "sources-gathered")]
    assert [(e.data.index, e.data.text) for e in of_type(history, "run.output")] == [
        (0, "Searching the web for 'HTTP/3'.\n"), (1, "Two sources agree; writing the summary.\n")]
    assert history.state.status == "completed"


# --- cancellation and skips ----------------------------------------------------------


def cancel_requested(run: RunEvents) -> Event:
    return run.make(RunCancelRequested)


async def test_a_cancel_signal_aborts_a_running_child(log, start_runner, nc):
    await start_runner(Sleeper)
    run = await dispatch(log, "Sleeper", {"seconds": 30})
    await event_of(log, run, lambda e: e.type == "run.running")
    started = time.monotonic()
    await log.append(cancel_requested(run), expected_last_seq=None)
    await nc.publish(log.subjects.cancel_signal("Sleeper"),
                     CancelSignal(run_id=run.run_id, parent=PARENT).model_dump_json().encode())
    state = (await finished(log, run)).state
    assert (state.status, state.aborted_cause, state.error) == ("aborted", "cancel", "cancelled")
    assert time.monotonic() - started < 1.0


class Stubborn(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        while True:  # noqa: ASYNC110 - never looks at ctx.cancelled: the child under test
            await asyncio.sleep(0.01)


async def test_a_child_that_ignores_cancellation_is_stopped_after_the_grace(
        log, start_runner, nc):
    await start_runner(Stubborn)
    run = await dispatch(log, "Stubborn", {})
    await event_of(log, run, lambda e: e.type == "run.running")
    await nc.publish(log.subjects.cancel_signal("Stubborn"),
                     CancelSignal(run_id=run.run_id, parent=PARENT).model_dump_json().encode())
    assert (await finished(log, run)).state.status == "aborted"


async def test_the_cancel_grace_is_the_configured_one(log, start_runner, nc):
    # TETHER_CANCEL_GRACE_MS: a child that ignores the cancellation is stopped after it.
    await start_runner(Stubborn, settings={"cancel_grace_ms": 100})
    run = await dispatch(log, "Stubborn", {})
    await event_of(log, run, lambda e: e.type == "run.running")
    started = time.monotonic()
    await nc.publish(log.subjects.cancel_signal("Stubborn"),
                     CancelSignal(run_id=run.run_id, parent=PARENT).model_dump_json().encode())
    assert (await finished(log, run)).state.status == "aborted"
    assert 0.1 <= time.monotonic() - started < 0.8


async def test_a_missed_cancel_signal_is_noticed_at_the_heartbeat(log, start_runner):
    await start_runner(Sleeper, settings={"work_ack_wait_ms": 600})
    run = await dispatch(log, "Sleeper", {"seconds": 30})
    await event_of(log, run, lambda e: e.type == "run.running")
    await log.append(cancel_requested(run), expected_last_seq=None)  # and no signal
    assert (await finished(log, run, timeout=5)).state.status == "aborted"


async def test_a_heartbeat_whose_read_failed_reads_the_run_again_at_the_next_beat(
        log, start_runner, monkeypatch):
    await start_runner(Sleeper, settings={"work_ack_wait_ms": 600})
    run = await dispatch(log, "Sleeper", {"seconds": 30})
    await event_of(log, run, lambda e: e.type == "run.running")
    read_run, failures = EventLog.read_run, []

    async def failing_once(self, *args, **kwargs):
        if not failures:
            failures.append(args)
            raise TimeoutError("the read timed out")
        return await read_run(self, *args, **kwargs)

    monkeypatch.setattr(EventLog, "read_run", failing_once)
    # The beat after this sees the run's subject move, and its read of the run fails; the
    # subject does not move again, so only a beat that reads again notices the cancel.
    await log.append(cancel_requested(run), expected_last_seq=None)  # and no signal
    assert (await finished(log, run, timeout=5)).state.status == "aborted"
    assert failures


async def test_a_run_cancelled_before_it_started_is_aborted_without_running(log, start_runner):
    await start_runner(Sleeper)
    run = await dispatch(log, "Sleeper", {"seconds": 30}, lambda run: [cancel_requested(run)])
    history = await finished(log, run)
    assert history.state.status == "aborted"
    assert of_type(history, "run.running") == []


@pytest.fixture
def runner_reads(monkeypatch) -> list[str]:
    """The run ids the runners read from the log (every `EventLog.read_run` in the test)."""
    reads: list[str] = []
    read_run = EventLog.read_run

    async def counting(self, parent, run_id, **options):
        reads.append(run_id)
        return await read_run(self, parent, run_id, **options)

    monkeypatch.setattr(EventLog, "read_run", counting)
    return reads


async def test_a_new_runs_item_starts_it_without_reading_the_run(log, start_runner,
                                                                 runner_reads):
    await start_runner(Researcher)
    run = await dispatch(log, "Researcher", {"query": "HTTP/3"})
    await event_of(log, run, lambda e: e.type in TERMINAL)
    assert runner_reads == [], "the item carried the request: nothing to read"
    history = await log.read_run(PARENT, run.run_id)
    assert history.state.status == "completed" and history.state.attempt == 1


async def test_an_item_whose_run_moved_after_its_request_is_decided_from_the_log(
        log, start_runner, runner_reads):
    # The parent's item carries the request; a cancel appended since makes the append of
    # run.running conflict, and the run read then is aborted without running.
    await start_runner(Sleeper)
    run = RunEvents(f"r-{uuid.uuid4().hex[:8]}", PARENT)
    requested = run.requested("Sleeper", input={"seconds": 30})
    seq = await log.append(requested, expected_last_seq=0)
    await log.append(cancel_requested(run), expected_last_seq=seq)
    await publish_item(log, WorkItem(run_id=run.run_id, parent=PARENT, agent_type="Sleeper",
                                     attempt=0, requested=requested, requested_seq=seq))
    history = await finished(log, run)
    assert history.state.status == "aborted"
    assert of_type(history, "run.running") == []
    assert run.run_id in runner_reads


async def test_a_second_item_for_a_started_run_is_skipped_and_a_redelivery_takes_over(
        log, start_runner):
    # A repeated request publishes a starting run's item again; once the first has started
    # the run, the second's first delivery must not restart the child.
    runner = await start_runner(Sleeper, shutdown_grace_s=0.05)
    run = await dispatch(log, "Sleeper", {"seconds": 30})
    await event_of(log, run, lambda e: e.type == "run.running")
    again = WorkItem(run_id=run.run_id, parent=PARENT, agent_type="Sleeper", attempt=0)
    await publish_item(log, again, msg_id=f"work:{run.run_id}:start:again")
    outcome = await asyncio.wait_for(runner.outcomes.get(), timeout=10)
    assert (outcome.run_id, outcome.kind, outcome.detail) == (
        run.run_id, "skipped", "another work item already started the run")
    # The runner holding the run stops and gives it back: its item's redelivery is the
    # run's, and takes it over as the next attempt.
    second = await start_runner(Sleeper, shutdown_grace_s=0.05)
    await runner.stopped()
    running = await event_of(log, run, lambda e: e.type == "run.running" and e.data.attempt == 2)
    assert running.data.runner_id == second.runner.runner_id
    history = await log.read_run(PARENT, run.run_id)
    assert [e.data.attempt for e in of_type(history, "run.running")] == [1, 2]


async def test_a_finished_or_cleared_run_is_skipped(log, start_runner):
    runner = await start_runner(Sleeper)
    done = await dispatch(log, "Sleeper", {"seconds": 30},
                          lambda run: [run.running(), run.completed("earlier")])
    outcome = await asyncio.wait_for(runner.outcomes.get(), timeout=10)
    assert (outcome.run_id, outcome.kind) == (done.run_id, "skipped")
    assert len((await log.read_run(PARENT, done.run_id)).events) == 3

    missing = WorkItem(run_id="r-never-requested", parent=PARENT, agent_type="Sleeper")
    await log.jetstream.publish(log.subjects.work("Sleeper"), work_item_json(missing))
    outcome = await asyncio.wait_for(runner.outcomes.get(), timeout=10)
    assert (outcome.run_id, outcome.kind) == ("r-never-requested", "skipped")


async def test_a_child_of_a_cleared_run_leaves_the_run_ids_next_life_alone(log, start_runner):
    """The run is cleared and its id requested again while its child still runs: the
    child's outcome belongs to the cleared life and is not recorded on the new one."""
    Holding.release = asyncio.Event()
    # No heartbeat before the end: the outcome's own append must tell the lives apart.
    runner = await start_runner(Holding, settings={"work_ack_wait_ms": 60_000})
    run = await dispatch(log, "Holding", {})
    await event_of(log, run, lambda e: e.type == "run.running")
    requested_again = RunEvents(run.run_id, PARENT, id_prefix="again").requested("Holding", input={})
    for event in (run.cleared(), requested_again):
        await log.append(event, expected_last_seq=None)
    Holding.release.set()

    outcome = await asyncio.wait_for(runner.outcomes.get(), timeout=10)
    assert (outcome.run_id, outcome.kind) == (run.run_id, "skipped")
    assert outcome.detail == ("the child finished; the run was cleared while the child "
                              "ran: nothing recorded")
    history = await log.read_run(PARENT, run.run_id)
    assert history.events[-1].event_id == requested_again.event_id
    assert (history.state.status, history.state.attempt) == ("starting", 0)


async def test_a_run_out_of_attempts_fails_with_a_clear_error(log, start_runner):
    await start_runner(Sleeper, settings={"max_attempts": 2})
    run = await dispatch(log, "Sleeper", {"seconds": 30},
                         lambda run: [run.running(1), run.running(2)])
    state = (await finished(log, run)).state
    assert state.status == "error"
    assert state.error.startswith("gave up after 2 attempts")


# --- runners ------------------------------------------------------------------------


async def test_a_stopping_runner_gives_its_run_back_and_another_resumes_it(log, start_runner):
    first = await start_runner(Sleeper, shutdown_grace_s=0.05)
    # Long enough that the first runner is still running it after the second one has
    # started and the first has stopped fetching (a busy machine took over 0.4 s).
    run = await dispatch(log, "Sleeper", {"seconds": 1.8, "milestones": 3})
    await event_of(log, run, lambda e: e.type == "run.milestone")
    second = await start_runner(Sleeper)
    await first.stopped()
    assert (await first.outcomes.get()).kind == "released"

    history = await finished(log, run)
    assert history.state.status == "completed"
    assert [(e.data.attempt, e.data.runner_id) for e in of_type(history, "run.running")] == [
        (1, first.runner.runner_id), (2, second.runner.runner_id)]
    assert [e.data.name for e in of_type(history, "run.milestone")] == ["step-1", "step-2",
                                                                        "step-3"]
    assert len(of_type(history, "run.completed")) == 1


class Counting(ChildAgent):
    running = 0
    most = 0

    async def run(self, ctx: RunContext, input: Any) -> str:
        Counting.running += 1
        Counting.most = max(Counting.most, Counting.running)
        await asyncio.sleep(0.1)
        Counting.running -= 1
        return "counted"


async def test_no_more_children_run_at_once_than_the_concurrency_allows(log, start_runner):
    await start_runner(Counting, settings={"runner_concurrency": 2})
    runs = [await dispatch(log, "Counting", {}) for _ in range(5)]
    for run in runs:
        assert (await finished(log, run)).state.status == "completed"
    assert Counting.most == 2


async def test_the_work_consumer_is_durable_shared_and_configured(log, start_runner, settings):
    await start_runner(Sleeper, settings={"max_attempts": 4})
    info = await log.jetstream.consumer_info(settings.subjects.work_stream, consumer_name("Sleeper"))
    assert info.config.durable_name == "runner-Sleeper"
    assert info.config.filter_subject == settings.subjects.work("Sleeper")
    assert info.config.ack_wait == 1.0
    assert info.config.max_deliver == 4 + MAX_DELIVER_MARGIN


# --- outside a run -------------------------------------------------------------------


async def test_report_progress_outside_a_run_is_a_no_op_with_one_warning(monkeypatch):
    monkeypatch.setattr(context_module, "_warned_outside_run", False)
    configured = structlog.is_configured()
    try:
        with structlog.testing.capture_logs() as logs:
            await report_progress(fraction=0.5, message="nobody listens")
            await report_progress(milestone="ignored")
            summary = await Researcher().run(RunContext.standalone("Researcher"),
                                             ResearchInput(query="HTTP/3"))
            await Researcher().report_progress(fraction=1.0)
    finally:
        if not configured:
            # capture_logs leaves structlog configured on its way out: the library's
            # records would no longer reach `logging` (and the later tests' caplog).
            structlog.reset_defaults()
    assert summary.startswith("HTTP/3")
    assert [entry["event"] for entry in logs] == ["report_progress.outside_run"]
    with pytest.raises(ValueError, match="from 0 to 1"):
        await report_progress(fraction=1.5)
    with pytest.raises(ValueError, match="invalid milestone name"):
        await RunContext.standalone().report_progress(milestone="has spaces")


async def test_a_runner_cancelled_instead_of_stopped_ends_at_once_and_gives_its_item_back(
        nc, log, settings):
    """`tether services all` cancels the services that have not stopped when another one
    failed: a cancelled runner ends its fetch loops and gives its running children's work
    items back at once, instead of waiting for a stop that never comes."""
    outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
    runner = await open_runner(nc, settings.model_copy(update={"work_ack_wait_ms": 1000}),
                         AgentRegistry([Stubborn]), on_outcome=outcomes.put_nowait,
                         fetch_timeout_s=0.3, cancel_grace_s=0.2)
    task = asyncio.create_task(runner.run(asyncio.Event()))  # a stop nobody sets
    run = await dispatch(log, "Stubborn", {})
    await event_of(log, run, lambda e: e.type == "run.running")
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)  # the shutdown grace is 20 s
    assert done == {task} and task.cancelled()
    outcome = await asyncio.wait_for(outcomes.get(), 5)
    assert (outcome.run_id, outcome.kind) == (run.run_id, "released")


class Dated(ChildAgent):
    """Returns when its runner let it start, and when its first line ran (epoch ms)."""

    async def run(self, ctx: RunContext, input: Any) -> dict:
        return {"started_at": ctx.started_at, "first_line_at": SYSTEM_CLOCK.now()}


async def test_a_child_knows_when_its_runner_let_it_start(log, start_runner):
    await start_runner(Dated)
    before = SYSTEM_CLOCK.now()
    run = await dispatch(log, "Dated", {})
    output = (await finished(log, run)).state.output
    assert before <= output["started_at"] <= output["first_line_at"]
