"""Durable chat readers when something goes wrong under them, against a real nats-server:
their consumer deleted while they read, a message too large to hand over, a reader paused
past its ack wait. Each says what
happened rather than failing with an error that names nothing, or not answering."""

import asyncio
import signal
from contextlib import aclosing

import pytest
from authorized_nats import ALICE_PARENT
from chat_readers import ACK_WAIT_S, ChatReaderProcess, served_chat

from tether.adapters import chat_consumers
from tether.adapters.chat_consumers import ReaderDeleted
from tether.client import RequestFailed, connect
from tether.contract.messages import ChatMessage
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="user-1")


def chat_message(message_id: str, content: str = "hello") -> bytes:
    return ChatMessage(id=message_id, role="assistant", content=content,
                       metadata={}).model_dump_json().encode()


async def test_a_durable_reader_whose_consumer_is_deleted_under_it_says_so(log, settings):
    """Before, the reader's next pull failed with nats' "ServiceUnavailableError:
    description='None'" (a pull from a deleted consumer has no responders)."""
    await log.jetstream.publish(log.subjects.chat(PARENT), chat_message("m-1"))
    async with connect(settings=settings) as tether:
        reader = tether.parent(PARENT.agent, PARENT.name).chat(durable="app")
        async with aclosing(reader):
            assert (await asyncio.wait_for(anext(reader), 10)).id == "m-1"
            assert await tether.drop_chat_reader(PARENT, "app")
            with pytest.raises(ReaderDeleted, match="'app' of Assistant/user-1 was deleted"):
                await asyncio.wait_for(anext(reader), 10)
        async with aclosing(tether.parent(PARENT.agent, PARENT.name).chat(
                durable="app")) as again:  # read again: made anew, from the start
            assert (await asyncio.wait_for(anext(again), 10)).id == "m-1"


async def test_a_served_reader_whose_consumer_is_deleted_says_so_and_can_read_again(
        tmp_path, devstack, settings):
    """The parent kept the consumer for made: every later query failed with the same
    nameless error until the parent restarted."""
    async with served_chat(tmp_path, devstack, settings) as (alice, admin):
        js, subjects = admin.jetstream(), settings.subjects
        await js.publish(subjects.chat(ALICE_PARENT), chat_message("m-1"))
        async with connect(settings=alice) as app:
            reader = app.chat(ALICE_PARENT, durable="inbox")
            async with aclosing(reader):
                assert (await asyncio.wait_for(anext(reader), 10)).id == "m-1"
                await js.delete_consumer(subjects.chat_stream, "chat-AliceBot-user-1-inbox")
                with pytest.raises(RequestFailed, match="ReaderDeleted: the durable chat "
                                   "reader 'inbox' of AliceBot/user-1 was deleted"):
                    await asyncio.wait_for(anext(reader), 10)
            async with aclosing(app.chat(ALICE_PARENT, durable="inbox")) as again:
                assert (await asyncio.wait_for(anext(again), 10)).id == "m-1"


async def test_a_served_reader_says_which_message_is_too_large_to_hand_over(
        tmp_path, devstack, settings):
    """A chat message that fits the stream but not a `chat_next` reply (its JSON quoted
    again): before, the parent's reply was dropped and the reader only heard that the
    parent did not answer, at every try."""
    async with served_chat(tmp_path, devstack, settings) as (alice, admin):
        js, subjects = admin.jetstream(), settings.subjects
        await js.publish(subjects.chat(ALICE_PARENT), chat_message("m-1"))
        quotes = '"' * (admin.max_payload // 2 - 1000)  # each becomes four bytes in a reply
        large_seq = (await js.publish(subjects.chat(ALICE_PARENT),
                                      chat_message("large", quotes))).seq
        async with connect(settings=alice) as app:
            reader = app.chat(ALICE_PARENT, durable="inbox")
            async with aclosing(reader):
                assert (await asyncio.wait_for(anext(reader), 10)).id == "m-1"
                with pytest.raises(RequestFailed, match=(
                        rf"ChatMessageTooLarge: the chat message at seq {large_seq} of "
                        rf"AliceBot/user-1 makes a chat_next reply of \d+ bytes, more than "
                        rf"this NATS server's max_payload \({admin.max_payload}\)")):
                    await asyncio.wait_for(anext(reader), 10)


async def test_a_reader_paused_past_its_ack_wait_leaves_the_message_to_the_reader_that_has_it(
        log, settings, monkeypatch):
    """A reader process stopped (SIGSTOP) while it handles m-1: after the ack wait, the
    other reader of the name gets m-1. Continued, the stopped one must not acknowledge
    m-1 when it asks for the next: an acknowledgement names the message, so it would take
    m-1 from the other reader, and m-1 would be lost when that one dies before its own."""
    monkeypatch.setattr(chat_consumers, "ACK_WAIT_S", ACK_WAIT_S)
    await log.jetstream.publish(log.subjects.chat(PARENT), chat_message("m-1"))
    paused = await ChatReaderProcess(settings, PARENT).start()
    try:
        paused.signal(signal.SIGSTOP)
        async with connect(settings=settings) as other:
            reader = other.parent(PARENT.agent, PARENT.name).chat(durable="app")
            async with aclosing(reader):
                assert (await asyncio.wait_for(anext(reader), 10)).id == "m-1"
                paused.signal(signal.SIGCONT)
                paused.signal(signal.SIGUSR1)  # its handling ends: it asks for the next
                await paused.logged("test.chat_done", timeout=10)
                [lapsed] = await paused.logged("chat.handover_lapsed")
                assert lapsed["stream_seq"] == 1
            # `other` dies with m-1 unacknowledged: m-1 is handed over again.
        async with connect(settings=settings) as third, aclosing(
                third.parent(PARENT.agent, PARENT.name).chat(durable="app")) as again:
            assert (await asyncio.wait_for(anext(again), 10)).id == "m-1"
    finally:
        if paused.process and paused.process.returncode is None:
            paused.signal(signal.SIGCONT)
        await paused.stop()


async def test_a_served_reader_paused_past_its_ack_wait_leaves_the_message_to_the_other(
        tmp_path, devstack, settings, monkeypatch):
    """As above, for readers the parent serves: the stopped one's next query must not
    carry m-1's token to be acknowledged."""
    monkeypatch.setattr(chat_consumers, "ACK_WAIT_S", ACK_WAIT_S)
    async with served_chat(tmp_path, devstack, settings) as (alice, admin):
        await admin.jetstream().publish(settings.subjects.chat(ALICE_PARENT), chat_message("m-1"))
        paused = await ChatReaderProcess(alice, ALICE_PARENT).start()
        try:
            paused.signal(signal.SIGSTOP)
            async with connect(settings=alice) as other, aclosing(
                    other.chat(ALICE_PARENT, durable="app")) as reader:
                assert (await asyncio.wait_for(anext(reader), 10)).id == "m-1"
                paused.signal(signal.SIGCONT)
                paused.signal(signal.SIGUSR1)
                await paused.logged("test.chat_done", timeout=10)
                await paused.logged("chat.handover_lapsed")
            async with connect(settings=alice) as third, aclosing(
                    third.chat(ALICE_PARENT, durable="app")) as again:
                assert (await asyncio.wait_for(anext(again), 10)).id == "m-1"
        finally:
            if paused.process and paused.process.returncode is None:
                paused.signal(signal.SIGCONT)
            await paused.stop()
