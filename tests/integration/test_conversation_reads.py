"""What a conversation reads of its run's events against real JetStream: only the events
that belong to the subject they are stored on (`tether.ports.stored_event`)."""

import asyncio

import pytest
import structlog

from tether.client import connect
from tether.client.conversation import ConversationEnded
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
