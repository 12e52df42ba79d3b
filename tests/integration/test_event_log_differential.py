"""The in-memory event log (`tether.testing.InMemoryEventLog`) answers as the JetStream one
does: one scenario, run against both, must observe the same sequences, conflicts,
duplicates, histories and follows. The unit tests that use the fake rely on this."""

import asyncio
from contextlib import aclosing

import msgspec
import pytest

from tether.adapters.event_log import EventLog
from tether.domain import events as ev
from tether.domain.events import ParentRef
from tether.ports import ConcurrencyConflict
from tether.testing import InMemoryEventLog, RunEvents


def _ids(history) -> list[str]:
    return [e.event_id for e in history.events]


async def _scenario(log) -> list[object]:
    """What a caller of the port can observe, in order."""
    seen: list[object] = []
    subjects = log.subjects
    a = RunEvents("run-a")
    b = RunEvents("run-b", ParentRef(agent="Assistant", name="user-2"))

    requested = a.requested()
    first = await log.append(requested, expected_last_seq=0)
    seen.append(("first append", first))
    seen.append(("the same event again", await log.append(requested, expected_last_seq=0)))
    seen.append(("unconditional repeat", await log.append(requested, expected_last_seq=None)))
    try:
        await log.append(a.started(), expected_last_seq=0)
    except ConcurrencyConflict as conflict:
        seen.append(("stale expected sequence", conflict.subject, conflict.expected_last_seq))

    created = await log.append_new(b.requested())
    seen.append(("append_new of a new run", created[1], created[0].status))
    seen.append(("append_new of an existing run", await log.append_new(a.requested())))
    seen.append(("append_new of the same event", await log.append_new(requested)))

    started = a.started()
    seq = await log.append_batch([started, a.running()], expected_last_seq=first)
    seen.append(("batch", seq, await log.last_seq(a.parent, a.run_id)))

    # An undecodable message on the run's subject: skipped by reads, covered by last_seq.
    garbage = await log.publish(subjects.run_events(a.parent, a.run_id), b"{not json",
                                headers={"Nats-Msg-Id": "garbage-1"},
                                stream=subjects.events_stream)
    seen.append(("garbage", garbage.seq, bool(garbage.duplicate)))
    history = await log.read_run(a.parent, a.run_id)
    seen.append(("history", _ids(history), history.last_seq, history.state.status))
    before = await log.read_run(a.parent, a.run_id, before_seq=seq)
    seen.append(("before", _ids(before), before.last_seq, before.state.status))
    stored = await log.read_subject(subjects.run_events(a.parent, a.run_id), start_seq=2)
    seen.append(("subject", [(s.seq, s.event is None, s.pending) for s in stored]))

    # Two writers deciding from the same history, each with an event of its own: one
    # appends, the other's append is refused, and it decides again from a fresh read.
    def first_output(text: str):
        output = a.make(ev.RunOutput, index=0, text=text)
        return lambda state: [] if state.output_parts else [output]

    results = await asyncio.gather(log.update(a.parent, a.run_id, first_output("one")),
                                   log.update(a.parent, a.run_id, first_output("two")))
    seen.append(("racing updates", [len(appended) for _, appended in results],
                 [state.output_text for state, _ in results]))
    state, appended, at = await log.update_at(a.parent, a.run_id, lambda s: [])
    seen.append(("nothing to decide", state.status, appended, at,
                 await log.last_seq(a.parent, a.run_id)))
    # The same through `recent`: a writer deciding from what it remembers of the run,
    # after another moved it, is refused and decides again from what the run is now.
    other = a.make(ev.RunOutput, index=1, text="other")
    await log.append(other, expected_last_seq=None)
    state, appended = await log.recent.update(
        a.parent, a.run_id, lambda s: [] if 1 in s.output_parts else [other])
    seen.append(("recent update after a move", state.output_text, appended))
    state, appended, at = await log.recent.update_at(a.parent, a.run_id, lambda s: [])
    seen.append(("recent, nothing to decide", state.output_text, appended, at))
    completed = a.completed("done")
    state, appended, at = await log.update_at(a.parent, a.run_id, lambda s: [completed])
    seen.append(("completed", state.status, [e.event_id for e in appended], at))
    seen.append(("no such run", (await log.read_run(a.parent, "nobody")).last_seq,
                 await log.last_seq(a.parent, "nobody")))

    # Another stream's acknowledged publish, deduplicated by its message id.
    work = [await log.publish(subjects.work("Researcher"), b"{}", headers={"Nats-Msg-Id": "w1"},
                              stream=subjects.work_stream) for _ in range(2)]
    seen.append(("work", [(ack.seq, bool(ack.duplicate)) for ack in work]))

    # A follow from the start sees every message in order, then goes on live.
    async with aclosing(log.follow_batches(subjects.all_events, start_seq=1,
                                           max_batch=4)) as batches:
        replayed = []
        async for batch in batches:
            replayed += [(s.seq, s.subject.rsplit(".", 1)[-1], s.event is None) for s in batch]
            if replayed[-1][0] == at:
                break
        seen.append(("follow", replayed))
        live = asyncio.ensure_future(anext(batches))
        await log.append(b.started(), expected_last_seq=created[1])
        seen.append(("live", [(s.seq, s.pending) for s in await asyncio.wait_for(live, 5)]))

    # A clear keeps only the tombstone: everything before it is purged.
    tombstone = a.cleared()
    last = await log.append(tombstone, expected_last_seq=at)
    info = await log.jetstream.stream_info(subjects.events_stream,
                                           subjects_filter=subjects.parent_events(a.parent)[:-1] + "*")
    seen.append(("subjects", dict(info.state.subjects)))
    seen.append(("run ids", await log.run_ids(a.parent), await log.run_ids(b.parent),
                 await log.stream_last_seq()))
    await log.jetstream.purge_stream(subjects.events_stream, seq=last,
                                     subject=subjects.run_events(a.parent, a.run_id))
    cleared = await log.read_run(a.parent, a.run_id)
    seen.append(("cleared", _ids(cleared), cleared.last_seq, cleared.state))
    return seen


async def test_the_in_memory_log_observes_what_the_jetstream_log_does(log: EventLog, settings):
    real = await _scenario(log)
    fake = await _scenario(InMemoryEventLog(settings.subjects))
    assert fake == real
    # The scenario is not vacuous: it saw a conflict, a lost race and a duplicate.
    assert any(step[0] == "stale expected sequence" for step in real)
    assert ("racing updates", [1, 0], ["one", "one"]) in real
    assert ("work", [(1, False), (1, True)]) in real


@pytest.mark.parametrize("same_event", [True, False])
async def test_a_retried_append_after_the_run_moved_tells_its_own_event_apart(
        log: EventLog, settings, same_event: bool):
    async def retry(target) -> object:
        run = RunEvents("run-retry")
        requested = await target.append(run.requested(), expected_last_seq=0)
        started = run.started()
        await target.append(started, expected_last_seq=requested)
        await target.append(run.running(), expected_last_seq=requested + 1)
        try:
            return await target.append(started if same_event else msgspec.structs.replace(
                started, event_id="another"), expected_last_seq=requested)
        except ConcurrencyConflict as conflict:
            return ("conflict", conflict.expected_last_seq)

    assert await retry(InMemoryEventLog(settings.subjects)) == await retry(log)
