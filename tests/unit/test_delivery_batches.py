"""A parent agent's delivery ledger: one `deliveries.recorded` for the deliveries a hook
handler reported together, read by followers of the log as each run's own
`run.finish_delivered`."""

import asyncio
from pathlib import Path

import pytest

from tether.contract.subjects import Subjects, is_delivery_ledger
from tether.domain.commands import DeliveredCommand
from tether.domain.decide import delivery_entry_of_report
from tether.domain.delivery_batches import batch_of, decode_batch, encode_batch
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.domain.ids import finish_message_id
from tether.ports import stored_events
from tether.testing import InMemoryEventLog, RunEvents

AGENT = "Assistant"
METHOD = "on_done"


def finished(run_id: str, name: str = "user-1"):
    run = RunEvents(run_id, ParentRef(agent=AGENT, name=name))
    state = None
    for event in (run.requested(detached={"on_finish": METHOD}), run.running(), run.completed()):
        state = evolve(state, event).state
    return state


def report(state, message_id: str | None = None) -> DeliveredCommand:
    return DeliveredCommand(run_id=state.run_id, parent=state.parent, status="completed",
                            method=METHOD,
                            message_id=message_id or finish_message_id(state, "completed", METHOD))


def test_reports_naming_their_lives_are_one_batch_each_entry_its_runs_own_entry():
    states = [finished("a-1"), finished("a-2", name="user-2")]
    old = finished("a-3")
    reports = [report(states[0]), report(old, "finish:a-3:completed"), report(states[1])]
    batch, alone = batch_of(reports, now=1_000)
    assert batch is not None and batch.parent_agent == AGENT
    assert [entry.run_id for entry in batch.entries] == ["a-1", "a-2"]
    assert alone == [reports[1]]  # an id from an earlier version names no life: on its run
    # Each entry reads as the event the parent appends for that report alone.
    assert batch.as_events() == [delivery_entry_of_report(reports[0], 1_000),
                                 delivery_entry_of_report(reports[2], 1_000)]
    for state, event in zip(states, batch.as_events(), strict=True):
        assert evolve(state, event).state.finish_delivered("completed", METHOD)


def test_a_batch_of_the_same_deliveries_has_the_same_id_whatever_their_order():
    states = [finished("b-1"), finished("b-2")]
    first, _ = batch_of([report(s) for s in states], now=1)
    again, _ = batch_of([report(s) for s in reversed(states)], now=2)
    other, _ = batch_of([report(states[0]), report(finished("b-3"))], now=1)
    assert first.event_id == again.event_id != other.event_id
    assert first.event_id.startswith(f"deliveries:{AGENT}:")


def test_one_report_or_none_naming_a_life_makes_no_batch():
    state = finished("c-1")
    assert batch_of([report(state)], now=1) == (None, [report(state)])
    unnamed = [report(state, "finish:c-1:completed"), report(finished("c-2"), "finish:c-2:completed")]
    assert batch_of(unnamed, now=1) == (None, unnamed)


def test_a_follower_reads_a_ledger_message_as_its_entries_on_their_runs_subjects():
    subjects = Subjects("pfx")
    states = [finished("d-1"), finished("d-2", name="user-2")]
    batch, _ = batch_of([report(s) for s in states], now=7)
    subject = subjects.delivery_ledger(AGENT)
    assert subject == "pfx.evt.Assistant._ledger" and is_delivery_ledger(subject)
    stored = stored_events(42, subject, encode_batch(batch), pending=3, logged_at=9)
    assert [(s.seq, s.subject, s.event.type, s.pending, s.logged_at) for s in stored] == [
        (42, subjects.run_events(state.parent, state.run_id), "run.finish_delivered", 3, 9)
        for state in states]
    assert decode_batch(encode_batch(batch)) == batch


def test_a_ledger_message_that_does_not_decode_is_one_dead_letter():
    [stored] = stored_events(5, "pfx.evt.Assistant._ledger", b'{"type": "deliveries.recorded"}')
    assert stored.event is None and stored.error.kind == "invalid"
    assert "deliveries.recorded" in str(stored.error)


@pytest.mark.parametrize("run_id", ["_ledger", "x._ledger"])
def test_no_run_subject_is_taken_for_a_ledger(run_id):
    assert not is_delivery_ledger(f"pfx.evt.{AGENT}.user-1.{run_id}")


def test_the_in_memory_log_follows_and_reads_a_ledger_as_the_jetstream_log_does():
    async def scenario():
        log = InMemoryEventLog()
        states = [finished("e-1"), finished("e-2")]
        batch, _ = batch_of([report(s) for s in states], now=3)
        seq = await log.record_deliveries(batch)
        assert await log.record_deliveries(batch) == seq  # a repeat is stored once
        followed = await anext(log.follow_batches(log.subjects.all_events))
        read = await log.read_subject(log.subjects.delivery_ledger(AGENT))
        assert [(s.seq, s.event.run_id) for s in followed] == [(seq, "e-1"), (seq, "e-2")]
        assert read == followed

    asyncio.run(scenario())


def test_the_stored_shape_of_version_1_still_reads_as_its_runs_entries():
    """The golden file: the shape the log keeps for ever."""
    raw = (Path(__file__).resolve().parents[1] / "golden" / "ledger"
           / "deliveries.recorded.v1.json").read_bytes()
    batch = decode_batch(raw)
    assert decode_batch(encode_batch(batch)) == batch
    events = batch.as_events()
    assert [(e.parent, e.run_id, e.data.status, e.data.method, e.event_id) for e in events] == [
        (ParentRef(agent="Assistant", name="user-42"), "run-7f3a9c2e", "completed",
         "on_research_done", "run-7f3a9c2e:0a1b2c3d4e:finish_delivered:on_research_done:completed"),
        (ParentRef(agent="Assistant", name="user-43"), "run-9d01", "error",
         "on_agent_tool_finish",
         "run-9d01:5f6a7b8c9d:finish_delivered:on_agent_tool_finish:error")]
    assert {e.occurred_at for e in events} == {1767225613750}
