"""The services' faster nats-py client: every override of nats-py's private methods.

Used only where `Settings.nats_fast_path` (`TETHER_NATS_FAST_PATH`, on by default) asks for
it, by the services and the CLI; an application's `tether.connect()` gets nats-py's own
client. Each override gives nats-py's observable behaviour (tests/unit/test_nats_parsing.py
and tests/integration/test_nats_fastpath.py hold each against nats-py's own), for less CPU:

- received headers parsed in one pass (`_parse_header_lines`);
- a publish's header block built in one join (`_send_publish`);
- routed subscriptions (`subscribe_routed`): a message goes from the read loop straight
  to a plain function, past the subscription's queue, its task and a coroutine per
  message (`_process_msg`, `_remove_sub`);
- subscriptions whose data messages' headers nobody reads (`skip_headers`: an event
  follower's), which then are not parsed; a status (a JetStream heartbeat or flow
  control) still is;
- followed ordered consumers (`route_follow`): an event follower's data messages go from
  the read loop straight to its sink, with nats-py's ordered-consumer bookkeeping (the
  consumer sequence checked, a gap resuming the consumer after the last delivered
  event) but without a message object, a queue and a task per message; the flow
  control the server asks for is answered once the sink has room.

The overrides lean on nats-py internals, so the fast path is only taken on the nats-py
releases it was tested with (`TESTED`); on any other, `supported()` is False and the
services use nats-py's own client.
"""

import weakref
from collections.abc import Callable
from importlib.metadata import version
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

try:  # names of nats-py's header checks: in the releases of `TESTED`
    from nats.aio.client import _HEADER_KEY_RE, _HEADER_VALUE_NEWLINES
    from nats.errors import BadHeaderError
except ImportError:  # another nats-py: `supported()` is False
    _HEADER_KEY_RE = _HEADER_VALUE_NEWLINES = None  # type: ignore[assignment]
    BadHeaderError = ValueError  # type: ignore[misc,assignment]

# The nats-py minor releases whose internals these overrides were tested against.
TESTED = ("2.16",)
_VALID_HEADER_NAMES: set[str] = set()  # names `FastClient` has checked as nats-py does
# A received header block starts `NATS/1.0`; a space after it begins a status line.
_STATUS_AT, _SPACE = len(b"NATS/1.0"), ord(" ")
_FLOW_CONTROL = b"NATS/1.0 100 FlowControl"
# A consumer's delivery reply: $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.
# <consumer seq>.<time>.<pending> (the longer form, with a domain, takes nats-py's path).
_ACK_TOKENS, _STREAM_SEQ, _CONSUMER_SEQ, _PENDING = 9, 5, 6, 8


class FollowSink(Protocol):
    """Where a followed ordered consumer's events go (`FastClient.route_follow`)."""

    def deliver(self, seq: int, subject: str, data: bytes, pending: int) -> None: ...

    def hold_flow_control(self, reply: str) -> bool:
        """Whether the sink keeps the server's flow-control request to answer once it has
        room (True), or it is to be answered now."""


def supported() -> bool:
    """Whether the installed nats-py is one the overrides were tested against."""
    installed = ".".join(version("nats-py").split(".")[:2])
    return installed in TESTED and _HEADER_KEY_RE is not None


class FastClient(NATS):
    """nats-py's client with the overrides above."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: dict[int, Callable[[Msg], None]] = {}
        self.headers_unread: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self.follows: weakref.WeakKeyDictionary[Subscription, FollowSink] = (
            weakref.WeakKeyDictionary())

    async def subscribe_routed(self, subject: str, route: Callable[[Msg], None]) -> Subscription:
        subscription = await self.subscribe(subject)
        self.routes[subscription._id] = route  # noqa: SLF001 - nats-py keeps the sid private
        return subscription

    def skip_headers(self, subscription: Any) -> None:
        """Leave the headers of `subscription`'s data messages unparsed (`msg.headers`
        None); a JetStream subscription is given by its connection-level one, which it
        keeps across an ordered consumer's resets."""
        self.headers_unread.add(getattr(subscription, "_sub", subscription))

    def route_follow(self, subscription: Any, sink: FollowSink) -> None:
        """The data messages of `subscription`, an ordered consumer's, go to `sink` (given
        by its connection-level subscription, which it keeps across the consumer's resets);
        its heartbeats still take nats-py's path."""
        self.follows[getattr(subscription, "_sub", subscription)] = sink

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes | None) -> None:
        route = self.routes.get(sid)
        if route is None:
            sub = self._subs.get(sid)
            sink = self.follows.get(sub) if sub is not None else None
            if sink is not None and await self._followed(sub, sink, subject, reply, data,
                                                         headers):
                return
            if (headers and len(headers) > _STATUS_AT and headers[_STATUS_AT] != _SPACE
                    and sub in self.headers_unread):
                headers = b""
            await super()._process_msg(sid, subject, reply, data, headers or b"")
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        # (Most routed replies, a stream's acks, have no headers to parse.)
        parsed = await self._process_headers(headers) if headers else None
        msg = self._build_message(sid, subject, reply, data, parsed)
        if msg is not None:
            route(msg)

    async def _followed(self, sub: Any, sink: FollowSink, subject: bytes, reply: bytes,
                        data: bytes, headers: bytes | None) -> bool:
        """A followed consumer's message, handled as nats-py's `_process_msg` handles an
        ordered consumer's; False: one for nats-py's path (a heartbeat, or a reply in
        another form, after which the rest of the consumer's messages take it too, in
        order)."""
        jsi = sub._jsi  # noqa: SLF001 - nats-py's ordered-consumer state
        if headers and len(headers) > _STATUS_AT and headers[_STATUS_AT] == _SPACE:
            if not (reply and headers.startswith(_FLOW_CONTROL)):
                return False  # a heartbeat: nats-py checks the consumer's sequence with it
            self.stats["in_msgs"] += 1
            jsi._active = True  # noqa: SLF001
            answer = reply.decode()
            if not sink.hold_flow_control(answer):
                await self.publish(answer)
            return True
        tokens = reply.split(b".")
        if len(tokens) != _ACK_TOKENS or tokens[0] != b"$JS":
            del self.follows[sub]
            return False
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        jsi._active = True  # noqa: SLF001
        consumer_seq = int(tokens[_CONSUMER_SEQ])
        if consumer_seq != jsi._dseq:  # noqa: SLF001 - a gap: resume after the last delivered
            await jsi.reset_ordered_consumer(jsi._sseq + 1)  # noqa: SLF001
            return True
        seq = int(tokens[_STREAM_SEQ])
        jsi._dseq, jsi._sseq = consumer_seq + 1, seq  # noqa: SLF001
        sub._received += 1  # noqa: SLF001 - what nats-py's flow control counts as delivered
        jsi.track_sequences(reply.decode())  # the last delivery, for the heartbeats' check
        sink.deliver(seq, subject.decode(), data, int(tokens[_PENDING]))
        return True

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        super()._remove_sub(sid, max_msgs)
        self.routes.pop(sid, None)  # one per awaited run: none may stay behind

    async def _send_publish(self, subject: str, reply: str, payload: bytes, payload_size: int,
                            headers: dict[str, str] | None) -> None:
        """nats-py's, with the header block built in one join (every event, work item and
        hook carries some): the same bytes, for about half the time."""
        if not headers or not subject:
            await super()._send_publish(subject, reply, payload, payload_size, headers)
            return
        lines = ["NATS/1.0"]
        for name, value in headers.items():
            # (nats-py's own names are str enums: `strip` gives the plain value, which
            # formatting one would not.)
            if type(name) is not str or name not in _VALID_HEADER_NAMES:
                key = name.strip()
                if not key:
                    continue  # as nats-py: an empty name is left out
                if not _HEADER_KEY_RE.fullmatch(key):
                    raise BadHeaderError(key)
                if key == name and type(name) is str and len(_VALID_HEADER_NAMES) < 256:
                    _VALID_HEADER_NAMES.add(name)
                name = key
            lines.append(f"{name}: {value.strip().translate(_HEADER_VALUE_NEWLINES)}")
        lines.append("\r\n")
        block = "\r\n".join(lines).encode()
        size = len(block)
        command = b"".join((f"HPUB {subject} {reply} {size} {size + payload_size}\r\n".encode(),
                            block, payload, b"\r\n"))
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += payload_size
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        headers: dict[str, str] = {}
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            name, colon, value = line.partition(":")
            if not colon:
                continue
            key = name.strip()
            # An ASCII name with no whitespace inside; anything else is skipped.
            if not key.isascii() or len(key.split()) > 1:
                continue
            headers[key] = value.strip()
        return headers
