"""Garbage in the events stream as the codec and `stored_events` read it: whatever a
message holds, a consumer gets an event or an `EventDecodeError`, never another exception,
and never an event applied to a run other than the one whose subject stores it."""

import json

import pytest
import structlog

from tether.adapters.deliveries import marked_delivered
from tether.contract.codec import EventDecodeError, decode_event, encode_event
from tether.contract.subjects import Subjects
from tether.domain.delivery_batches import DeliveriesRecorded, RecordedDelivery, encode_batch
from tether.domain.events import ParentRef
from tether.ports import run_history, stored_event, stored_events
from tether.testing import RunEvents

SUBJECTS = Subjects("pfx")
PARENT = ParentRef(agent="Assistant", name="remote")
DEEP = "[" * 3000 + "]" * 3000


def with_data(event_json: bytes, data: str) -> bytes:
    text = event_json.decode()
    assert '"data":null' in text
    return text.replace('"data":null', f'"data":{data}', 1).encode()


def test_an_event_nested_past_the_stack_in_its_data_is_malformed_not_a_recursion_error():
    deep = with_data(encode_event(RunEvents("r1", PARENT).milestone("deep")), DEEP)
    with pytest.raises(EventDecodeError, match="nested too deeply") as raised:
        decode_event(deep)
    assert raised.value.kind == "malformed"


def test_an_old_shaped_event_nested_past_the_stack_is_malformed_too():
    event = json.loads(encode_event(RunEvents("r1", PARENT).milestone("deep")))
    event["schema_version"] = 1  # the slow path: parsed, then upcast
    raw = json.dumps(event, separators=(",", ":")).encode()
    with pytest.raises(EventDecodeError, match="nested too deeply") as raised:
        decode_event(with_data(raw, DEEP))
    assert raised.value.kind == "malformed"


def test_a_stored_message_nested_past_the_stack_is_one_the_fold_skips():
    run = RunEvents("r1", PARENT)
    subject = SUBJECTS.run_events(PARENT, "r1")
    stored = [stored_event(1, subject, encode_event(run.requested())),
              stored_event(2, subject, with_data(encode_event(run.milestone("deep")), DEEP)),
              stored_event(3, subject, encode_event(run.running()))]
    assert stored[1].event is None and stored[1].error is not None
    assert stored[1].error.kind == "malformed"
    history = run_history(stored)
    assert [e.type for e in history.events] == ["run.requested", "run.running"]
    assert history.last_seq == 3


def test_an_event_of_another_run_stored_on_this_runs_subject_does_not_decode():
    liar = RunEvents("lb", PARENT).completed("completed by a liar")
    subject = SUBJECTS.run_events(PARENT, "la")
    [stored] = stored_events(7, subject, encode_event(liar))
    assert stored.event is None and stored.error is not None
    assert stored.error.kind == "invalid"
    assert str(stored.error) == f"names Assistant/remote/lb, stored on {subject}"


def test_an_event_of_another_parent_stored_on_this_parents_subject_does_not_decode():
    foreign = RunEvents("la2", ParentRef(agent="Victim", name="tenant-9")).requested("Sleeper")
    subject = SUBJECTS.run_events(PARENT, "la2")
    [stored] = stored_events(8, subject, encode_event(foreign))
    assert stored.event is None and stored.error is not None
    assert str(stored.error) == f"names Victim/tenant-9/la2, stored on {subject}"


def test_an_event_on_its_own_subject_or_its_live_republication_decodes():
    event = RunEvents("la", PARENT).running()
    for subject in (SUBJECTS.run_events(PARENT, "la"), SUBJECTS.run_live(PARENT, "la")):
        assert stored_event(1, subject, encode_event(event)).event == event


@pytest.mark.parametrize("subject", [
    "pfx.evt.Other.Assistant.remote.la",  # one token more, the event's tokens at its end
    "pfx.evt.evt.Assistant.remote.la",
    "pfx.progress.Assistant.remote.la",
    "pfx.evt.Assistant.remote.la2",
    "pfx.evt.Assistant.remote2.la",
])
def test_an_event_on_any_other_subject_does_not_decode(subject):
    event = RunEvents("la", PARENT).running()
    assert stored_event(1, subject, encode_event(event)).error is not None


def test_a_delivery_ledger_naming_another_parent_agent_does_not_decode():
    batch = DeliveriesRecorded(
        event_id="batch-1", parent_agent="Victim", occurred_at=5,
        entries=[RecordedDelivery(parent_name="tenant-9", run_id="r1", status="completed",
                               method="on_done", message_id="r1:completed:on_done")])
    [stored] = stored_events(9, SUBJECTS.delivery_ledger("Assistant"), encode_batch(batch))
    assert stored.event is None and stored.error is not None
    assert stored.error.kind == "invalid"
    assert "names parent agent Victim" in str(stored.error)


@pytest.mark.parametrize("value", [b"garbage{", b"\xff\xfe", b"[1, 2]", b'"delivered"',
                                   DEEP.encode()])
def test_an_unreadable_delivery_record_counts_as_absent_with_a_warning(value):
    configured = structlog.is_configured()
    try:
        with structlog.testing.capture_logs() as logs:
            assert marked_delivered(value, "PFX_DELIVERIES", "A.b.on_done.m1") is False
    finally:
        if not configured:  # capture_logs leaves structlog configured on its way out
            structlog.reset_defaults()
    assert [(e["event"], e["log_level"], e["bucket"], e["key"]) for e in logs] == [
        ("deliveries.unreadable_record", "warning", "PFX_DELIVERIES", "A.b.on_done.m1")]


def test_a_readable_delivery_record_says_whether_it_was_delivered():
    assert marked_delivered(b'{"state": "delivered"}', "B", "k") is True
    assert marked_delivered(b'{"state": "other"}', "B", "k") is False
    assert marked_delivered(None, "B", "k") is False
