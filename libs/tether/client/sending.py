"""A steering message sent to a run, and its wait until the parent records it
(`ParentHandle.send`)."""

import asyncio
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tether.client.arguments import check_seconds, expires_in_ms, first_error, ids_of
from tether.client.errors import MessageRefused
from tether.client.feed import FeedMessage, UnreadableEvent, feed_events, open_feed
from tether.client.link import Link
from tether.client.placing import UnsentMessage, WaitingReport
from tether.domain.commands import SendCommand
from tether.domain.events import ParentRef, RunRejected
from tether.domain.fold import evolve
from tether.domain.ids import check_identifier

# How long `send` waits for a parent service to record the message.
SEND_TIMEOUT_S = 30.0


class MessageReceipt(BaseModel):
    """A steering message the parent recorded in the run's log (`ParentHandle.send`)."""

    run_id: str
    message_id: str
    mode: str


async def send_message(tether: Link, ref: ParentRef, run_id: str, text: str | None = None, *,
                       data: Any = None, mode: Literal["queue", "interrupt"] = "queue",
                       message_id: str | None = None, below: Iterable[str] = (),
                       expires_in: float | None = None, timeout: float = SEND_TIMEOUT_S,
                       on_waiting: WaitingReport) -> MessageReceipt:
    """`ParentHandle.send`, which says what it does."""
    check_identifier(run_id, "run id")
    check_seconds(timeout, "timeout", none_allowed=False)
    message_id = check_identifier(message_id or uuid.uuid4().hex, "message id")
    try:
        command = SendCommand(run_id=run_id, parent=ref, below=ids_of(below, "below"),
                              message_id=message_id, text=text, data=data, mode=mode,
                              expires_in_ms=expires_in_ms(expires_in))
    except ValidationError as error:
        raise ValueError(f"invalid send request: {first_error(error)}") from None
    parent, target = ref, run_id
    for next_id in command.below:  # where the parent records it: down the tree
        above = (await tether.read_run(parent, target)).state
        if above is None:
            raise MessageRefused(f"no run {target!r} of {parent.agent}/{parent.name}",
                                 "no-such-run")
        parent, target = above.as_parent(), next_id
    subjects = tether.subjects
    recorded_on = subjects.run_events(parent, target)
    # Expiry is a cancellation inside the block and a TimeoutError only out of it:
    # the explanation is raised here, outside.
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline, open_feed(tether, subjects.events_stream,
                                       recorded_on) as feed:
            ack = await tether.publish_command(
                "send", command,
                f"send:{ref.agent}.{ref.name}:{run_id}:{message_id}")
            unsent = UnsentMessage(tether, ref, target, message_id, expires_in,
                                   on_waiting)
            return await _message_recorded(feed.sink, target, message_id, ack.seq,
                                           unsent)
    except TimeoutError:
        if not deadline.expired():
            raise
        later = ("" if expires_in is None else
                 f", unless that is more than {expires_in:g} s after it was sent: then it "
                 "is dropped")
        raise TimeoutError(
            f"no parent service recorded message {message_id!r} for run {target!r} "
            f"within {timeout:g}s (waited for it on {recorded_on}): it waits in the "
            f"commands stream ({subjects.commands_stream}) and is applied when a parent "
            f"service with prefix {subjects.prefix!r} takes it{later}") from None


async def _message_recorded(sink: "asyncio.Queue[FeedMessage]", run_id: str,
                            message_id: str, command_seq: int,
                            unsent: UnsentMessage) -> MessageReceipt:
    """Fold the run's events until the message is in them (`MessageReceipt`), or the
    parent refused this command on the run's subject (`MessageRefused`); while neither,
    `unsent` looks whether any parent service answers, and ends the wait at the
    message's expiry. A message that does not decode, or names another run than its
    subject (`feed_events`), is not the answer."""
    loop = asyncio.get_running_loop()
    state = None
    while True:
        try:
            async with asyncio.timeout(unsent.next_look_in(loop.time())):
                stored = await sink.get()
        except TimeoutError:
            await unsent.look(loop.time())
            continue
        for event in feed_events(stored):
            if isinstance(event, RunRejected) and event.causation_id == f"cmd:{command_seq}":
                raise MessageRefused(event.data.error, event.data.code)
            if not isinstance(event, UnreadableEvent):
                state = evolve(state, event).state
        if state is not None and (message := state.message(message_id)) is not None:
            return MessageReceipt(run_id=run_id, message_id=message_id, mode=message.mode)
