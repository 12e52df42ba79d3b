"""A connection's refused publishes, told to whoever waits on them.

The server answers a publish this connection's user may not make with an asynchronous
`-ERR`, not with a reply: without this, the request behind it would only time out.
"""

import asyncio
import contextlib
import re
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from nats.aio.client import Client as NATS

T = TypeVar("T")


class PublishDenied(Exception):
    """The NATS server refused this connection's publish: its user may not publish there."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"NATS refused this connection's publish to {subject}: "
                         "its user's permissions do not allow it")
        self.subject = subject


# A refused publish, or a refused subscription (`observe`'s, say), which the server
# reports the same way.
_PUBLISH_DENIED = re.compile(r'permissions violation for (?:publish|subscription) to "([^"]+)"',
                             re.IGNORECASE)


class Denials:
    """Who is told the subject of each publish the server refused this connection
    (`-ERR 'Permissions Violation for Publish to "<subject>"'`, which nats-py hands to its
    `error_cb`, lowercased): routed requests' methods, weak so that one goes with its
    owner, and `unless_refused`'s callbacks, which remove themselves."""

    def __init__(self) -> None:
        self.listeners: list[weakref.WeakMethod[Callable[[str], None]]] = []
        self.callbacks: list[Callable[[str], None]] = []

    def seen(self, error: BaseException) -> None:
        if (denied := _PUBLISH_DENIED.search(str(error))) is None:
            return
        subject = denied[1].lower()
        for reference in list(self.listeners):
            listener = reference()
            if listener is None:
                self.listeners.remove(reference)
            else:
                listener(subject)
        for callback in list(self.callbacks):
            callback(subject)


# The connections `connect_nats` made, whose refused publishes are reported.
_DENIALS: "weakref.WeakKeyDictionary[NATS, Denials]" = weakref.WeakKeyDictionary()


def watch(nc: NATS) -> Denials:
    """Report `nc`'s refused publishes from now on; its `error_cb` passes each error to
    the returned `Denials.seen`."""
    denials = _DENIALS[nc] = Denials()
    return denials


def on_denied(nc: NATS, method: Callable[[str], None]) -> None:
    """Call the bound `method` with the subject of each publish refused to `nc`, for as
    long as its object lives; nothing on a connection `watch` was not given."""
    if (denials := _DENIALS.get(nc)) is not None:
        denials.listeners.append(weakref.WeakMethod(method))


async def unless_refused(nc: NATS, prefix: str, operation: Awaitable[T]) -> T:
    """`operation`'s result, or `PublishDenied` as soon as the server refuses this
    connection a publish to a subject starting with `prefix`: for a request nats-py makes
    itself (a consumer create, a key-value put), which would otherwise only time out.
    On a connection `connect_nats` did not make, just `operation`."""
    if nc not in _DENIALS:
        return await operation
    running = asyncio.ensure_future(operation)
    with refusal_of(nc, prefix) as refused:
        waiting: set[asyncio.Future[Any]] = {running, refused}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            running.cancel()
            raise
    if running.done():  # its result, its error or its own cancellation, as it ended
        return running.result()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    raise PublishDenied(refused.result())


@contextlib.contextmanager
def refusal_of(nc: NATS, prefix: str) -> Iterator["asyncio.Future[str]"]:
    """A future set with the subject when the server refuses this connection one starting
    with `prefix` (a publish, or a subscription whose refusal comes whenever the server
    sends it, not before a later answer); never set on a connection `connect_nats` did
    not make."""
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    wanted = prefix.lower()

    def listener(denied: str) -> None:
        if denied.startswith(wanted) and not refused.done():
            refused.set_result(denied)

    denials = _DENIALS.get(nc)
    if denials is not None:
        denials.callbacks.append(listener)
    try:
        yield refused
    finally:
        if denials is not None:
            denials.callbacks.remove(listener)
