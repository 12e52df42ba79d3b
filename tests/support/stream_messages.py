"""The next messages stored on a subject, read the way a late subscriber reads them."""

from tether.adapters.event_log import EventLog


async def next_messages(log: EventLog, subject: str, count: int, timeout: float = 10) -> list:
    """The first `count` messages of `subject` in its stream (an ordered consumer from
    the stream's start), each waited for up to `timeout` seconds."""
    subscription = await log.jetstream.subscribe(subject, ordered_consumer=True)
    try:
        return [await subscription.next_msg(timeout=timeout) for _ in range(count)]
    finally:
        await subscription.unsubscribe()
