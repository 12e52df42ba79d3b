"""The JetStream event log: streams, dedupe, optimistic concurrency, reads and follows."""

import asyncio
import time
from contextlib import aclosing

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api as js_api
from nats.js.errors import APIError, NoStreamResponseError

from tether.adapters.event_log import WRONG_LAST_SEQUENCE, EventLog
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams, stream_configs
from tether.domain import decide, recovery_decisions
from tether.domain.events import ParentRef, RunCompleted
from tether.domain.fold import fold
from tether.ports import ConcurrencyConflict
from tether.testing import RunEvents


async def test_streams_are_created_with_explicit_settings_and_updated_in_place(nc, settings):
    js = nc.jetstream()
    await ensure_streams(js, settings.subjects, StreamSettings(duplicate_window_s=30))
    events = await js.stream_info(settings.subjects.events_stream)
    assert events.config.storage == js_api.StorageType.FILE
    assert events.config.subjects == [f"{settings.prefix}.evt.>"]
    assert events.config.duplicate_window == 30
    work = await js.stream_info(settings.subjects.work_stream)
    assert work.config.retention == js_api.RetentionPolicy.WORK_QUEUE
    progress = await js.stream_info(settings.subjects.progress_stream)
    assert progress.config.max_msgs_per_subject == 1

    await ensure_streams(js, settings.subjects, StreamSettings(duplicate_window_s=90))
    events = await js.stream_info(settings.subjects.events_stream)
    assert events.config.duplicate_window == 90
    assert len(stream_configs(settings.subjects, StreamSettings())) == 6
    await remove_streams(js, settings.subjects)


async def test_an_append_retried_with_the_same_event_id_is_stored_once(log: EventLog):
    run = RunEvents("r-dedupe")
    requested = run.requested()
    first = await log.append(requested, expected_last_seq=0)
    again = await log.append(requested, expected_last_seq=0)
    assert again == first
    history = await log.read_run(run.parent, run.run_id)
    assert [e.event_id for e in history.events] == [requested.event_id]
    assert history.last_seq == first


async def test_two_writers_deciding_from_the_same_history_never_both_succeed(log: EventLog):
    run = RunEvents("r-race")
    await log.append(run.requested(), expected_last_seq=0)
    seen = await log.read_run(run.parent, run.run_id)
    first, second = run.completed("from writer one"), run.failed("from writer two")
    results = await asyncio.gather(
        log.append(first, expected_last_seq=seen.last_seq),
        log.append(second, expected_last_seq=seen.last_seq),
        return_exceptions=True,
    )
    conflicts = [r for r in results if isinstance(r, ConcurrencyConflict)]
    assert len(conflicts) == 1
    assert sum(isinstance(r, int) for r in results) == 1
    history = await log.read_run(run.parent, run.run_id)
    assert len(history.events) == 2


async def test_the_loser_re_reads_and_decides_again(log: EventLog):
    run = RunEvents("r-update")
    await log.append(run.requested(), expected_last_seq=0)
    decisions: list[str] = []

    def finish_once(writer: str):
        def decide(state):
            decisions.append(writer)
            if state is None or state.is_hard_terminal:
                return []
            return [run.completed(f"finished by {writer}")]
        return decide

    outcomes = await asyncio.gather(*(
        log.update(run.parent, run.run_id, finish_once(f"w{i}")) for i in range(8)
    ))
    appended = [events for _, events in outcomes if events]
    assert len(appended) == 1, "exactly one writer completes the run"
    assert all(state.status == "completed" for state, _ in outcomes)
    assert len(decisions) > 8, "losers decided again after a conflict"
    history = await log.read_run(run.parent, run.run_id)
    assert sum(isinstance(e, RunCompleted) for e in history.events) == 1


async def test_a_stale_expected_sequence_is_a_conflict_not_an_append(log: EventLog):
    run = RunEvents("r-stale")
    await log.append(run.requested(), expected_last_seq=0)
    with pytest.raises(ConcurrencyConflict):
        await log.append(run.started(), expected_last_seq=0)
    assert len((await log.read_run(run.parent, run.run_id)).events) == 1


class CountingLog(EventLog):
    """An EventLog that counts how often it reads a run's history from the server."""

    reads = 0

    async def read_subject(self, subject, **kwargs):
        self.reads += 1
        return await super().read_subject(subject, **kwargs)


def _append_if_missing(event):
    def decide(state):
        if state is None or any(m.name == event.data.name for m in state.milestones):
            return []
        return [event]
    return decide


async def test_a_run_this_process_just_read_or_wrote_is_decided_on_without_reading_again(
        nc, log: EventLog):
    mine = CountingLog(nc, log.subjects)
    run = RunEvents("r-known")
    await mine.recent.update(run.parent, run.run_id,
                             lambda s: [run.requested()] if s is None else [])
    await mine.recent.update(run.parent, run.run_id, _append_if_missing(run.milestone("one")))
    await mine.recent.update(run.parent, run.run_id, _append_if_missing(run.milestone("two")))
    state, appended = await mine.recent.update(
        run.parent, run.run_id, lambda s: [run.completed("ok")] if s.milestones else [])
    assert mine.reads == 1, "only the first decision read the run"
    assert appended and state.status == "completed"
    assert [m.name for m in state.milestones] == ["one", "two"]
    fresh = await log.read_run(run.parent, run.run_id)
    # The remembered run is the fold of the stored events; a read also counts the
    # deadlines from when the stream stored them, which an append's answer does not say.
    assert fold(fresh.events) == state


async def test_a_plain_update_reads_the_run_every_time_even_one_this_process_knows(
        nc, log: EventLog):
    mine = CountingLog(nc, log.subjects)
    run = RunEvents("r-plain")
    requested, _ = await mine.recent.update(run.parent, run.run_id,
                                            lambda s: [run.requested()] if s is None else [])
    seen = []
    await mine.update(run.parent, run.run_id,
                      lambda s: seen.append(s.status) or [run.milestone("one")])
    await mine.update_at(run.parent, run.run_id, _append_if_missing(run.milestone("two")))
    assert mine.reads == 3, "each plain update read the run, though it was remembered"
    # What they read and appended is written through: the next `recent` update needs no read.
    state, _ = await mine.recent.update(run.parent, run.run_id,
                                        lambda s: [run.completed("ok")])
    assert mine.reads == 3
    assert [m.name for m in state.milestones] == ["one", "two"] and seen == [requested.status]


async def test_an_append_expecting_no_sequence_is_unconditional_and_forgets_the_run(
        nc, log: EventLog):
    mine = CountingLog(nc, log.subjects)
    run = RunEvents("r-unconditional")
    subject = log.subjects.run_events(run.parent, run.run_id)
    await mine.update(run.parent, run.run_id, lambda s: [run.requested()] if s is None else [])
    assert mine.recent_runs.get(subject) is not None, "what it appended is written through"
    seq = await mine.append(run.milestone("fact"), expected_last_seq=None)
    stored, _ = await log.read_stored(log.subjects.events_stream, subject, start_seq=seq, size=1)
    assert "Nats-Expected-Last-Subject-Sequence" not in (stored[0].headers or {})
    assert mine.recent_runs.get(subject) is None, "the run after it is unknown without a read"
    state, _ = await mine.recent.update(run.parent, run.run_id, lambda s: [])
    assert mine.reads == 2
    assert [m.name for m in state.milestones] == ["fact"]


async def known_then_moved(nc, log: EventLog, run_id: str,
                           theirs: str) -> tuple[CountingLog, RunEvents]:
    """A run `mine` created (so it knows it), then another writer added a milestone."""
    mine, other_writer = CountingLog(nc, log.subjects), EventLog(nc, log.subjects)
    run = RunEvents(run_id)
    await mine.update(run.parent, run.run_id, lambda s: [run.requested()] if s is None else [])
    await other_writer.append(run.milestone(theirs), expected_last_seq=None)
    return mine, run


async def test_what_another_writer_appended_meanwhile_is_read_before_deciding_again(
        nc, log: EventLog):
    mine, run = await known_then_moved(nc, log, "r-moved", theirs="theirs")

    def complete_after_theirs(state):
        if state.is_hard_terminal:
            return []
        return [run.completed(f"after {[m.name for m in state.milestones]}")]

    state, appended = await mine.recent.update(run.parent, run.run_id, complete_after_theirs)
    assert [e.type for e in appended] == ["run.completed"]
    assert state.summary == "after ['theirs']", "the conflict made it decide on the fresh run"
    assert mine.reads == 2
    history = await log.read_run(run.parent, run.run_id)
    assert [e.type for e in history.events] == ["run.requested", "run.milestone", "run.completed"]


async def test_nothing_to_do_is_only_concluded_from_a_fresh_read(nc, log: EventLog):
    mine, run = await known_then_moved(nc, log, "r-noop", theirs="needed")

    def react_to_needed(state):
        if any(m.name == "needed" for m in state.milestones) and not state.is_hard_terminal:
            return [run.completed("reacted")]
        return []  # what the stale state says: nothing to do

    state, appended = await mine.recent.update(run.parent, run.run_id, react_to_needed)
    assert [e.type for e in appended] == ["run.completed"]
    assert state.status == "completed"


async def test_an_unconditional_append_lands_even_when_the_run_moved_elsewhere(
        nc, log: EventLog):
    mine, run = await known_then_moved(nc, log, "r-fact", theirs="theirs")
    await mine.append(run.milestone("mine"), expected_last_seq=None)
    state, _ = await mine.recent.update(run.parent, run.run_id, lambda s: [])
    assert [m.name for m in state.milestones] == ["theirs", "mine"]
    assert mine.reads >= 2, "what it knew was dropped, and the run read again"


async def test_read_run_folds_the_history_of_one_run_only(log: EventLog):
    mine, other = RunEvents("r-mine"), RunEvents("r-other")
    for event in (mine.requested(), other.requested(), mine.running(), other.failed(),
                  mine.milestone("half"), mine.completed("ok")):
        await log.append(event, expected_last_seq=None)
    history = await log.read_run(mine.parent, mine.run_id)
    assert [e.type for e in history.events] == ["run.requested", "run.running",
                                                 "run.milestone", "run.completed"]
    assert history.state.status == "completed"
    assert history.state.milestones[0].name == "half"
    assert (await log.read_run(mine.parent, "r-missing")).state is None


async def test_a_parent_timeline_replays_then_follows_live_in_order(log: EventLog):
    parent = ParentRef(agent="Assistant", name="user-7")
    a, b = RunEvents("r-a", parent), RunEvents("r-b", parent)
    stranger = RunEvents("r-x", ParentRef(agent="Assistant", name="user-8"))
    before = [a.requested(), stranger.requested(), b.requested(), a.milestone("m0")]
    for event in before:
        await log.append(event, expected_last_seq=None)

    async def follow(start_seq: int) -> list[tuple[int, str]]:
        seen = []
        timeline = log.follow(log.subjects.parent_events(parent), start_seq=start_seq)
        async with aclosing(timeline) as stream:
            async for stored in stream:
                seen.append((stored.seq, stored.event.event_id))
                if stored.event.event_id == "r-b-3":
                    return seen

    follower = asyncio.create_task(follow(1))
    after = [b.running(), a.completed(), b.completed()]
    for event in after:
        await log.append(event, expected_last_seq=None)
    received = await asyncio.wait_for(follower, timeout=10)

    ids = [event_id for _, event_id in received]
    assert ids == ["r-a-1", "r-b-1", "r-a-2", "r-b-2", "r-a-3", "r-b-3"]
    seqs = [seq for seq, _ in received]
    assert seqs == sorted(set(seqs)), "ordered by stream sequence, no duplicates"

    late = await asyncio.wait_for(follow(seqs[2]), timeout=10)
    assert late == received[2:], "a follower starting from a sequence sees the same suffix"


async def test_a_runs_first_event_is_appended_without_a_read_only_onto_an_empty_subject(
        log: EventLog):
    fresh, again = RunEvents("n-1"), RunEvents("n-1", id_prefix="again")
    first = fresh.requested()
    created = await log.append_new(first)
    assert created is not None
    state, seq = created
    assert (state.run_id, state.status) == (first.run_id, "starting")
    assert seq == await log.last_seq(fresh.parent, "n-1")
    # The subject is not empty, whatever the event; the same event is stored once.
    assert await log.append_new(again.requested()) is None
    assert await log.append_new(first) is None
    history = await log.read_run(fresh.parent, "n-1")
    assert [e.event_id for e in history.events] == [first.event_id]
    # A cleared run leaves a tombstone: its next request must be decided from a read.
    cleared = RunEvents("n-2")
    for event in (cleared.requested(), cleared.cleared()):
        await log.append(event, expected_last_seq=None)
    assert await log.append_new(RunEvents("n-2", id_prefix="later").requested()) is None
    assert len((await log.read_run(cleared.parent, "n-2")).events) == 2


@pytest.fixture(params=["tether client", "plain nats-py client"])
async def any_log(request, nc, settings, log: EventLog):
    """The log on our client (routed replies) and on an application's own nats-py client."""
    if request.param == "tether client":
        yield log
        return
    plain = await nats.connect(settings.nats_url, name="tether-tests-plain")
    yield EventLog(plain, settings.subjects)
    await plain.drain()


async def test_an_acked_publish_answers_as_nats_py_does(any_log: EventLog, nc, settings):
    """`EventLog.publish` replaces `JetStreamContext.publish` on the hot paths: the same
    ack for a stored, a duplicate and a refused message, and the same errors."""
    subject = settings.subjects.run_events(ParentRef(agent="A", name="a"), "r-ack")
    stream = settings.subjects.events_stream
    first = await any_log.publish(subject, b"{}", headers={"Nats-Msg-Id": "m1"}, stream=stream)
    reference = await nc.jetstream().publish(subject, b"{}", headers={"Nats-Msg-Id": "m2"},
                                             stream=stream)
    assert (first.stream, first.duplicate) == (stream, None)
    assert reference.seq == first.seq + 1

    again = await any_log.publish(subject, b"{}", headers={"Nats-Msg-Id": "m1"}, stream=stream)
    assert (again.seq, again.duplicate) == (first.seq, True)

    headers = {"Nats-Msg-Id": "m3", "Nats-Expected-Last-Subject-Sequence": str(first.seq)}
    with pytest.raises(APIError) as refused:
        await any_log.publish(subject, b"{}", headers=headers, stream=stream)
    assert refused.value.err_code == WRONG_LAST_SEQUENCE

    with pytest.raises(APIError) as wrong_stream:  # the subject is not the named stream's
        await any_log.publish(subject, b"{}", headers={}, stream=settings.subjects.work_stream)
    assert wrong_stream.value.code == 400

    with pytest.raises(NoStreamResponseError):
        await any_log.publish(f"{settings.prefix}.nowhere", b"{}", headers={}, stream=stream)

    # Many at once, each answered with its own ack.
    acks = await asyncio.gather(*(
        any_log.publish(subject, b"{}", headers={"Nats-Msg-Id": f"c{i}"}, stream=stream)
        for i in range(200)))
    assert sorted(ack.seq for ack in acks) == list(range(reference.seq + 1, reference.seq + 201))


async def test_an_acked_publish_nobody_answers_times_out_and_forgets_its_waiter(nc, settings):
    log = EventLog(nc, settings.subjects, timeout=0.05)
    silent = await nc.subscribe(f"{settings.prefix}.silent")  # takes it, never answers
    with pytest.raises(NatsTimeoutError):
        await log.publish(f"{settings.prefix}.silent", b"{}", headers={}, stream="ANY")
    await silent.unsubscribe()
    assert log.requests.waiting == 0


async def test_each_request_times_out_at_its_own_deadline_and_an_answered_one_never(nc, settings):
    timeout = 0.2
    log = EventLog(nc, settings.subjects, timeout=timeout)
    subject = f"{settings.prefix}.sometimes"
    received: asyncio.Queue = asyncio.Queue()

    async def take(msg) -> None:
        await received.put(msg)

    held = await nc.subscribe(subject, cb=take)
    loop = asyncio.get_running_loop()

    async def ask(name: str) -> tuple[str, float, float]:
        started = loop.time()
        try:
            reply = await log.requests.ask(subject, name.encode(), None)
            outcome = reply.data.decode()
        except NatsTimeoutError:
            outcome = "timed out"
        return outcome, started, loop.time()

    first = asyncio.ensure_future(ask("first"))  # nobody answers it
    assert (await received.get()).data == b"first"
    await asyncio.sleep(timeout / 2)
    second = asyncio.ensure_future(ask("second"))  # answered after the first timed out
    third = asyncio.ensure_future(ask("third"))  # nobody answers it
    to_answer = await received.get()
    assert to_answer.data == b"second"
    assert (await received.get()).data == b"third"

    outcome, started, ended = await first
    assert outcome == "timed out" and ended - started >= timeout
    await nc.publish(to_answer.reply, b"answered")
    assert (await second)[0] == "answered"
    outcome, started, ended = await third
    assert outcome == "timed out" and ended - started >= timeout
    await held.unsubscribe()
    assert log.requests.waiting == 0


async def test_the_last_sequence_of_a_run_is_read_by_a_subject_scoped_direct_get(log: EventLog):
    run = RunEvents("r-last")
    assert await log.last_seq(run.parent, run.run_id) == 0
    first = await log.append(run.requested(), expected_last_seq=0)
    await log.append(RunEvents("r-other").requested(), expected_last_seq=0)
    assert await log.last_seq(run.parent, run.run_id) == first
    second = await log.append(run.started(), expected_last_seq=first)
    assert await log.last_seq_of(log.subjects.run_events(run.parent, run.run_id)) == second


async def test_one_timers_decisions_for_same_named_runs_of_two_parents_both_land(
        log: EventLog):
    # Run ids repeat between parents (`agent-tool:call_0_0`); a reconciler may give up on
    # two of them in one millisecond. The log drops a repeated message id stream-wide,
    # so each decision's ids must name the run's parent.
    parents = [ParentRef(agent="Lead", name="run-a"), ParentRef(agent="Lead", name="run-b")]
    for parent in parents:
        run = RunEvents("agent-tool:call_0_0", parent, id_prefix=f"{parent.name}-ev")
        await log.append_batch([run.requested(), run.started(), run.running()],
                               expected_last_seq=0)
    cause = decide.timer_cause(now=5_000, origin="rec-test")
    for parent in parents:
        await log.update(parent, "agent-tool:call_0_0", lambda s: recovery_decisions.give_up(
            s, cause, "no-progress", "no progress", child_still_running=False))

    states = [(await log.read_run(parent, "agent-tool:call_0_0")).state for parent in parents]
    assert [(s.status, s.reason) for s in states] == [("interrupted", "no-progress")] * 2


async def test_a_read_counts_deadlines_from_when_the_stream_stored_the_events(log: EventLog):
    """A writer whose clock is an hour behind stamps `occurred_at` an hour early; the
    run's budget deadline still counts from the broker's stored time of its request."""
    late_clock = int(time.time() * 1000) - 3_600_000
    run = RunEvents("r-skewed", start_ms=late_clock)
    requested = run.requested(detached={}, max_budget_ms=60_000)
    before = int(time.time() * 1000)
    await log.append(requested, expected_last_seq=0)
    after = int(time.time() * 1000)

    history = await log.read_run(run.parent, run.run_id)
    followed = []
    async with asyncio.timeout(10), aclosing(log.follow(
            log.subjects.run_events(run.parent, run.run_id))) as events:
        async for stored in events:
            followed.append(stored)
            break

    assert history.state.requested_at == requested.occurred_at == late_clock
    assert before - 50 <= history.state.max_budget_deadline - 60_000 <= after + 50
    assert followed[0].logged_at == history.state.max_budget_deadline - 60_000
