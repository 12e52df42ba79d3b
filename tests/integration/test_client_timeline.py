"""The client's timeline against real JetStream, with run histories written directly.

No parent service: events are appended with `EventLog.append` and progress signals
published to the progress stream, exactly as the services would.
"""

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
from cuttable_proxy import cuttable_proxy
from misplaced_events import publish_misplaced
from runner_stack import running_stack

from examples.agents import Sleeper
from tether.adapters.event_log import EventLog
from tether.client import Tether, TimelineView, connect
from tether.client.render import timeline_lines
from tether.contract.messages import ProgressSignal
from tether.domain.events import ParentRef, RunMilestone, RunOutput, RunProgressPersisted
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


@pytest.fixture
async def tether(log: EventLog, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


async def append(log: EventLog, *events) -> None:
    for event in events:
        await log.append(event, expected_last_seq=None)


async def signal(log: EventLog, run_id: str, at: int, fraction: float, **fields) -> None:
    message = ProgressSignal(run_id=run_id, parent=PARENT, fraction=fraction, at=at, **fields)
    await log.jetstream.publish(log.subjects.run_progress(PARENT, run_id),
                                message.model_dump_json().encode(),
                                stream=log.subjects.progress_stream)


async def final_view(tether: Tether, **options) -> TimelineView:
    view = None
    timeline = tether.parent(PARENT.agent, PARENT.name).timeline(live=False, **options)
    async for view in timeline:  # noqa: B007 - the last view is wanted
        pass
    assert view is not None and view.caught_up
    return view


async def test_runs_are_grouped_by_tool_call_ordered_and_deduplicated(log, tether):
    second = RunEvents("run-b", PARENT, start_ms=1_000)
    first = RunEvents("run-a", PARENT, start_ms=1_100)
    free = RunEvents("run-c", PARENT, start_ms=1_200)
    milestone = second.milestone("sources-gathered", {"sources": 2})
    await append(
        log,
        second.requested(parent_tool_call_id="call-1", display_order=1), second.started(),
        second.running(), milestone, second.output("HTTP/3 "), second.output("runs on QUIC"),
        first.requested(parent_tool_call_id="call-1", display_order=0), first.running(),
        first.failed("search backend down"),
        free.requested(), free.running(), free.progress(0.25, "persisted"),
        free.interrupted("no-progress", child_still_running=True),
        second.completed("HTTP/3 runs on QUIC"),
    )
    # A second copy of a milestone and of an output chunk (new event ids, same keys).
    await append(log, second.make(RunMilestone, event_id="run-b-again-1", sequence=0,
                                  name="sources-gathered", data={"sources": 2}),
                 second.make(RunOutput, event_id="run-b-again-2", index=0, text="HTTP/3 "))
    await signal(log, "run-c", at=1_500, fraction=0.5, phase="searching", message="3 of 6")

    view = await final_view(tether)

    assert [run.run_id for run in view.runs_for_tool_call("call-1")] == ["run-a", "run-b"]
    assert [run.run_id for run in view.unbound_runs] == ["run-c"]
    assert view.tool_call_ids == ["call-1"]
    done = view.runs["run-b"]
    assert (done.status, done.summary, done.output_text) == (
        "completed", "HTTP/3 runs on QUIC", "HTTP/3 runs on QUIC")
    assert [(m.sequence, m.name, m.data) for m in done.milestones] == [
        (0, "sources-gathered", {"sources": 2})]
    assert done.progress.milestone == "sources-gathered" and done.progress.source == "persisted"
    failed = view.runs["run-a"]
    assert (failed.status, failed.error) == ("error", "search backend down")
    interrupted = view.runs["run-c"]
    assert (interrupted.status, interrupted.reason, interrupted.child_still_running) == (
        "interrupted", "no-progress", True)
    assert interrupted.progress.source == "signal", "the signal is newer than the snapshot"
    assert (interrupted.progress.fraction, interrupted.progress.phase) == (0.5, "searching")


async def test_an_empty_timeline_is_announced_once_caught_up(tether):
    view = await final_view(tether)
    assert view.runs == {} and view.caught_up


async def test_one_run_can_be_followed_alone(log, tether):
    mine, other = RunEvents("mine", PARENT), RunEvents("other", PARENT)
    await append(log, mine.requested(), other.requested(), mine.completed("ok"))
    await signal(log, "other", at=5_000, fraction=0.9)
    view = await final_view(tether, run_id="mine")
    assert list(view.runs) == ["mine"]


class Watcher:
    """An early subscriber running as its own task; tests wait for what it has seen."""

    def __init__(self, iterator: AsyncIterator[TimelineView]) -> None:
        self.views: list[TimelineView] = []
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._collect(iterator))

    async def _collect(self, iterator: AsyncIterator[TimelineView]) -> None:
        async for view in iterator:
            async with self._changed:
                self.views.append(view)
                self._changed.notify_all()

    async def until(self, done, timeout: float = 15) -> TimelineView:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: bool(self.views) and done(self.views[-1]))
            return self.views[-1]

    async def stop(self) -> None:
        while not self._task.done():  # a cancel can be swallowed by 3.11's wait_for
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=0.1)


def fraction_of(view: TimelineView, run_id: str) -> float | None:
    run = view.runs.get(run_id)
    return run.progress.fraction if run and run.progress else None


async def test_a_late_subscriber_ends_in_exactly_the_view_of_an_early_one(log, tether):
    early = Watcher(tether.parent(PARENT.agent, PARENT.name).timeline())
    try:
        assert (await early.until(lambda v: v.caught_up)).runs == {}

        clock = itertools.count(10_000, 10)
        runs = [RunEvents(f"run-{i}", PARENT, start_ms=1_000 * (i + 1)) for i in range(3)]
        for i, run in enumerate(runs):
            await append(log, run.requested(parent_tool_call_id="call-x", display_order=2 - i),
                         run.started(), run.running())
        for step in range(1, 5):  # signals and persisted progress interleaved, several per run
            for run in runs:
                await signal(log, run.run_id, at=next(clock), fraction=step / 5,
                             message=f"step {step}")
                if step % 2 == 1:
                    await append(log, run.make(RunProgressPersisted, at=next(clock),
                                               fraction=step / 5, message=f"persisted {step}"))
                if step == 3:
                    await append(log, run.milestone("halfway", {"step": step}))
            await early.until(lambda v, step=step: fraction_of(v, "run-1") == step / 5)
        await append(log, runs[0].completed("zero"), runs[1].failed("one failed"))
        # run-2 is cleared (its history purged but the tombstone, as the parent does) and
        # then requested again under the same id: its old signal must not show up.
        await log.append(runs[2].cleared(), expected_last_seq=None)
        await log.jetstream.purge_stream(log.subjects.events_stream,
                                         subject=log.subjects.run_events(PARENT, "run-2"), keep=1)
        reborn = RunEvents("run-2", PARENT, start_ms=50_000, id_prefix="reborn")
        await append(log, reborn.requested(), reborn.running(), reborn.output("again"))

        final = await early.until(lambda v: "run-2" in v.runs
                                  and v.runs["run-2"].output_text == "again"
                                  and v.runs["run-1"].status == "error")
    finally:
        await early.stop()
    late = await final_view(tether)

    assert late == final
    assert late.runs["run-2"].progress is None, "the signal of the cleared run is not shown"
    assert late.runs["run-0"].progress.source == "signal", "the last signal is the newest"
    assert late.runs["run-1"].progress.message == "step 4"
    assert [m.name for m in late.runs["run-1"].milestones] == ["halfway"]
    assert [r.run_id for r in late.runs_for_tool_call("call-x")] == ["run-1", "run-0"]
    assert [r.run_id for r in late.unbound_runs] == ["run-2"]
    fractions = [fraction_of(v, "run-1") for v in early.views if fraction_of(v, "run-1")]
    assert fractions == sorted(fractions) and set(fractions) >= {0.2, 0.4, 0.6, 0.8}


async def test_an_event_stored_where_it_does_not_belong_is_not_applied_and_is_shown(log, tether):
    """What a buggy client or a hand-run `nats pub` may put on a run's subject: another
    run's `run.completed`, another tenant's run of an id, a message that is no event. The
    timeline applies none of them (as the projector, which dead-letters them) and says
    each was there."""
    la, lb = RunEvents("la", PARENT), RunEvents("lb", PARENT)
    await append(log, la.requested(), la.running(), lb.requested(), lb.running())
    watcher = Watcher(tether.parent(PARENT.agent, PARENT.name).timeline())
    try:
        await watcher.until(lambda v: v.caught_up and len(v.runs) == 2)
        placed = await publish_misplaced(log, PARENT, la, lb)
        la_subject, lc_subject = placed.la_subject, placed.lc_subject
        liar_seq, foreign_seq, garbage_seq = placed.liar, placed.foreign, placed.garbage
        await append(log, la.completed("done"))
        view = await watcher.until(lambda v: v.runs["la"].status == "completed")
    finally:
        await watcher.stop()

    assert {run_id: run.status for run_id, run in view.runs.items()} == {
        "la": "completed", "lb": "running"}
    assert [(u.seq, u.subject) for u in view.unreadable] == [
        (liar_seq, la_subject), (foreign_seq, lc_subject), (garbage_seq, la_subject)]
    assert view.unreadable[0].reason == f"names Assistant/user-1/lb, stored on {la_subject}"
    assert view.unreadable[2].reason.startswith("not JSON")
    assert timeline_lines(view)[-3:] == [
        f"event at seq {liar_seq} could not be read: {view.unreadable[0].reason}",
        f"event at seq {foreign_seq} could not be read: names Victim/tenant-9/lc, stored on "
        + lc_subject,
        f"event at seq {garbage_seq} could not be read: {view.unreadable[2].reason}"]



async def test_a_progress_signal_stored_where_it_does_not_belong_is_not_shown_as_progress(
        log, tether):
    """Run lb's signal on la's progress subject, and one that is no signal: neither is
    any run's progress; the timeline says each was there."""
    la, lb = RunEvents("la", PARENT), RunEvents("lb", PARENT)
    await append(log, la.requested(), la.running(), lb.requested(), lb.running())
    la_subject = log.subjects.run_progress(PARENT, "la")
    lc_subject = log.subjects.run_progress(PARENT, "lc")
    liar = ProgressSignal(run_id="lb", parent=PARENT, fraction=0.9, message="by a liar", at=5_000)
    stream = log.subjects.progress_stream
    liar_seq = (await log.jetstream.publish(la_subject, liar.model_dump_json().encode(),
                                            stream=stream)).seq
    garbage_seq = (await log.jetstream.publish(lc_subject, b"not json", stream=stream)).seq

    view = await final_view(tether)

    assert (view.runs["la"].progress, view.runs["lb"].progress) == (None, None)
    assert timeline_lines(view)[-2:] == [
        f"progress signal at seq {liar_seq} could not be read: names Assistant/user-1/lb, "
        + f"stored on {la_subject}",
        f"progress signal at seq {garbage_seq} could not be read: {view.unreadable[1].reason}"]
    assert view.unreadable[1].reason.startswith("not a progress signal: Invalid JSON")


async def test_a_served_timeline_shows_a_run_end_lost_on_the_way_while_others_keep_it_busy(
        log, pool, settings):
    """An application in an account of its own reads the live subjects over core NATS, at
    most once. Its connection drops while a run ends: the end is lost, and no later
    message of that run shows the gap, while the parent's other run keeps the timeline
    busy. The feed asks the history again each idle heartbeat, busy or not, so the run
    shows its end instead of staying `running` for ever."""
    quiet, busy = RunEvents("quiet", PARENT), RunEvents("busy", PARENT)
    await append(log, quiet.requested(), quiet.running(), busy.requested(), busy.running())
    chunks = itertools.count()

    async def keep_busy() -> None:
        while True:
            await append(log, busy.output(f"{next(chunks)} "))
            await asyncio.sleep(0.1)  # a load's pace: the feed never waits a heartbeat

    async with (running_stack(settings, log, pool, [Sleeper], runner=False),
                cuttable_proxy(settings.nats_url) as proxy,
                connect(settings=settings.model_copy(update={"nats_url": proxy.url})) as app):
        served = Tether(app.nc, app.settings, served=True)
        watcher = Watcher(served.parent(PARENT.agent, PARENT.name).timeline())
        busying = asyncio.create_task(keep_busy())
        try:
            await watcher.until(lambda v: v.caught_up and len(v.runs) == 2)
            await proxy.cut()
            await append(log, quiet.completed("ended while the application was cut off"))
            proxy.restore()
            after_cut = next(chunks)
            await watcher.until(lambda v: f" {after_cut + 2} " in v.runs["busy"].output_text)
            view = await watcher.until(lambda v: v.runs["quiet"].status == "completed",
                                       timeout=20)
        finally:
            busying.cancel()
            await watcher.stop()
    assert view.runs["quiet"].summary == "ended while the application was cut off"
