"""What a conversation reads of its run's events against real JetStream: only the events
that belong to the subject they are stored on (`tether.ports.stored_event`)."""

import asyncio
import json

import pytest
import structlog

from tether.client import connect
from tether.client.conversation import ConversationEnded, UnreadableReply
from tether.contract.codec import encode_event
from tether.domain.events import ParentRef
from tether.testing import RunEvents


async def test_another_tenants_run_stored_on_a_conversations_subject_does_not_open_it(
        log, settings):
    """A `run.requested` naming another tenant's run of the same id, published on this
    conversation's subject (a buggy client, a hand-run `nats pub`), does not make the
    conversation look open: asking it says at once that it is not started, rather than
    waiting for an answer that will never come, and the event is logged where it is."""
    async with connect(settings=settings) as tether:
        conversation = tether.conversation("Concierge", "support", owner=("Assistant", "u42"))
        subject = log.subjects.run_events(conversation.owner.ref, "support")
        foreign = RunEvents("support", ParentRef(agent="Victim", name="tenant-9"))
        seq = (await log.jetstream.publish(subject, encode_event(
            foreign.requested("Concierge")))).seq
        configured = structlog.is_configured()
        try:
            with structlog.testing.capture_logs() as logs, \
                    pytest.raises(ConversationEnded, match="is not started"):
                await asyncio.wait_for(conversation.reply("any-message"), 10)
        finally:
            if not configured:  # capture_logs leaves structlog configured on its way out
                structlog.reset_defaults()
    [line] = [entry for entry in logs if entry["event"] == "conversation.unreadable_event"]
    assert (line["stream_seq"], line["subject"]) == (seq, subject)
    assert line["error"] == f"names Victim/tenant-9/support, stored on {subject}"


async def test_an_unreadable_answer_ends_the_wait_for_it_with_where_it_is(log, settings):
    """The model's answer to a message, stored in a shape this client cannot read (a
    newer or buggy writer, a hand-run `nats pub`), is not waited for forever: the wait
    ends with `UnreadableReply` naming its stream sequence. A garbage message before it,
    which answers nothing, is logged with its sequence and the wait goes on past it."""
    async with connect(settings=settings) as tether:
        conversation = tether.conversation("Concierge", "support", owner=("Assistant", "u42"))
        owner = conversation.owner.ref
        await log.jetstream.publish(log.subjects.run_events(owner, "support"), encode_event(
            RunEvents("support", owner).requested("Concierge")))
        subject = log.subjects.chat(*await conversation.chat())
        garbage_seq = (await log.jetstream.publish(subject, b"not json at all")).seq
        answer = {"id": "reply:support:1:0", "role": "robot", "content": "42",
                  "metadata": {"source": "model", "in_reply_to": ["user:m-1"]}}
        answer_seq = (await log.jetstream.publish(subject, json.dumps(answer).encode())).seq
        configured = structlog.is_configured()
        try:
            with structlog.testing.capture_logs() as logs, \
                    pytest.raises(UnreadableReply) as raised:
                await asyncio.wait_for(conversation.reply("user:m-1"), 10)
        finally:
            if not configured:
                structlog.reset_defaults()
    assert (raised.value.unreadable.seq, raised.value.unreadable.subject) == (answer_seq, subject)
    assert "role" in raised.value.unreadable.reason
    assert f"at seq {answer_seq}" in str(raised.value)
    lines = [entry for entry in logs if entry["event"] == "conversation.unreadable_message"]
    assert [(line["stream_seq"], line["subject"]) for line in lines] == [
        (garbage_seq, subject), (answer_seq, subject)]
