"""The services' faster nats-py client: every override of nats-py's private methods.

Used only where `Settings.nats_fast_path` (`TETHER_NATS_FAST_PATH`, on by default) asks for
it, by the services and the CLI; an application's `tether.connect()` gets nats-py's own
client. Each override gives nats-py's observable behaviour (tests/unit/test_nats_parsing.py
and tests/integration/test_nats_fastpath.py hold each against nats-py's own), for less CPU:

- the server's protocol read without regular expressions, each message's bytes copied
  once (`FastParser`), and a routed or followed message handed on without a coroutine;
- received headers parsed in one pass (`_parse_header_lines`);
- a publish's subjects checked without a regular expression (`publish`), and its header
  block built in one join (`_send_publish`);
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

import json
import weakref
from collections.abc import Callable
from importlib.metadata import version
from typing import Any, Protocol

from nats import errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ProtocolError
from nats.protocol.parser import ERR_RE, INFO_RE, OK_RE, PING_RE, PONG_RE, Parser

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
_ACK_TOKENS, _STREAM_SEQ, _CONSUMER_SEQ, _TIME, _PENDING = 9, 5, 6, 7, 8


class FollowSink(Protocol):
    """Where a followed ordered consumer's events go (`FastClient.route_follow`)."""

    def deliver(self, seq: int, subject: str, data: bytes, pending: int,
                logged_at: int) -> None:
        """`logged_at`: when the stream stored the message, on the broker's clock (ms)."""

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
        self._ps = FastParser(self)
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
        # (A routed reply without headers, a stream's ack, is handed on by `take`.)
        parsed = await self._process_headers(headers) if headers else None
        self._route(route, sid, subject, reply, data, parsed)

    def take(self, sid: int, subject: bytes, reply: bytes, data: bytes,
             headers: bytes | None) -> bool:
        """Hand on a routed message without headers (a stream's ack) or a followed
        consumer's next event, as `_process_msg` would, without a coroutine; False: one
        for `_process_msg`."""
        route = self.routes.get(sid)
        if route is not None:
            if headers:
                return False
            self._route(route, sid, subject, reply, data, None)
            return True
        sub = self._subs.get(sid)
        sink = self.follows.get(sub) if sub is not None else None
        return sink is not None and self._next_followed(sub, sink, subject, reply, data, headers)

    def _route(self, route: Callable[[Msg], None], sid: int, subject: bytes, reply: bytes,
               data: bytes, headers: dict[str, str] | None) -> None:
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        msg = self._build_message(sid, subject, reply, data, headers)
        if msg is not None:
            route(msg)

    def _next_followed(self, sub: Any, sink: FollowSink, subject: bytes, reply: bytes,
                       data: bytes, headers: bytes | None) -> bool:
        """A followed consumer's data message in consumer order, delivered to `sink`;
        False for any other (a status, a gap, a reply in another form)."""
        if headers and len(headers) > _STATUS_AT and headers[_STATUS_AT] == _SPACE:
            return False
        tokens = reply.split(b".")
        if len(tokens) != _ACK_TOKENS or tokens[0] != b"$JS":
            return False
        jsi = sub._jsi  # noqa: SLF001 - nats-py's ordered-consumer state
        consumer_seq = int(tokens[_CONSUMER_SEQ])
        if consumer_seq != jsi._dseq:  # noqa: SLF001
            return False
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        jsi._active = True  # noqa: SLF001
        seq = int(tokens[_STREAM_SEQ])
        jsi._dseq, jsi._sseq = consumer_seq + 1, seq  # noqa: SLF001
        sub._received += 1  # noqa: SLF001 - what nats-py's flow control counts as delivered
        jsi.track_sequences(reply.decode())  # the last delivery, for the heartbeats' check
        sink.deliver(seq, subject.decode(), data, int(tokens[_PENDING]),
                     int(tokens[_TIME]) // 1_000_000)
        return True

    async def _followed(self, sub: Any, sink: FollowSink, subject: bytes, reply: bytes,
                        data: bytes, headers: bytes | None) -> bool:
        """A followed consumer's message, handled as nats-py's `_process_msg` handles an
        ordered consumer's; False: one for nats-py's path (a heartbeat, or a reply in
        another form, after which the rest of the consumer's messages take it too, in
        order)."""
        if self._next_followed(sub, sink, subject, reply, data, headers):
            return True
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
        # A gap: resume after the last delivered.
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        jsi._active = True  # noqa: SLF001
        await jsi.reset_ordered_consumer(jsi._sseq + 1)  # noqa: SLF001
        return True

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        super()._remove_sub(sid, max_msgs)
        self.routes.pop(sid, None)  # one per awaited run: none may stay behind

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """nats-py's, with its check of the subjects (refused when empty or holding a
        space, a tab or a line break, which could end the protocol line) made by four
        scans instead of a regular expression search each."""
        if not self._skip_subject_validation:
            _check_subject(subject)
            if reply:
                _check_subject(reply)
        if self.is_closed:
            raise errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise errors.ConnectionDrainingError
        payload_size = len(payload)
        if not self.is_connected and (
                self._max_pending_size <= 0
                or payload_size + self._pending_data_size > self._max_pending_size):
            raise errors.OutboundBufferLimitError  # nothing can be kept for the reconnection
        if payload_size > self._max_payload:
            raise errors.MaxPayloadError
        await self._send_publish(subject, reply, payload, payload_size, headers)

    async def _send_publish(self, subject: str, reply: str, payload: bytes, payload_size: int,
                            headers: dict[str, str] | None) -> None:
        """nats-py's, with the header block built in one join (every event, work item and
        hook carries some): the same bytes."""
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
            value = value.strip()
            if "\r" in value or "\n" in value:  # (a translation looks up every character)
                value = value.translate(_HEADER_VALUE_NEWLINES)
            lines.append(f"{name}: {value}")
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


_CRLF = b"\r\n"
_MSG, _HMSG, _H = b"MSG ", b"HMSG ", ord("H")


class FastParser(Parser):
    """nats-py's protocol parser, with the same calls on the client for the same bytes,
    without its regular expressions: a message's control line is split on whitespace and
    its header block and payload are each sliced out of the received bytes once.

    A message that `FastClient.take` hands on needs no coroutine; any other goes to
    `_process_msg`. A message longer than what has arrived waits until its last byte
    has: the reads in between are kept, and joined once.
    """

    def reset(self) -> None:
        super().reset()
        self._unparsed = b""
        self._waiting: list[bytes] = []  # reads kept for a message not yet whole
        self._waiting_size = 0
        self._needed = 0  # the bytes `_unparsed` must hold before parsing goes on
        self._resets = getattr(self, "_resets", 0) + 1

    async def parse(self, data: bytes = b"") -> None:
        buf = self._gathered(data)
        if buf is None:
            return
        pos, end, resets, client = 0, len(buf), self._resets, self.nc
        try:
            while pos < end:
                eol = buf.find(_CRLF, pos)
                if eol < 0:
                    break  # the rest of a control line is still to come
                if not (buf.startswith(_MSG, pos) or buf.startswith(_HMSG, pos)):
                    line, pos = buf[pos:eol + 2], eol + 2
                    await self._control(line)
                else:
                    sid, subject, reply, header_size, size = _message_line(buf, pos, eol)
                    start = eol + 2
                    stop = start + size
                    if stop + 2 > end:
                        self._needed = stop + 2 - pos
                        break
                    headers = buf[start:start + header_size] if header_size else None
                    payload = buf[start + header_size:stop]
                    pos = stop + 2  # handed on below: consumed, as nats-py's parser has it
                    if client.take(sid, subject, reply, payload, headers):
                        continue
                    await client._process_msg(sid, subject, reply, payload, headers)  # noqa: SLF001
                if self._resets != resets:
                    return
        finally:
            # What is left is kept, however parsing ended (an error included), unless the
            # connection was reset meanwhile: what it read is void then.
            if self._resets == resets:
                self._unparsed = buf[pos:]

    def _gathered(self, data: bytes) -> bytes | None:
        """The bytes to parse now: what is left unparsed and `data`; None while the
        message begun is not whole yet (the reads are kept until it is)."""
        if self._waiting or len(self._unparsed) + len(data) < self._needed:
            self._waiting.append(data)
            self._waiting_size += len(data)
            if len(self._unparsed) + self._waiting_size < self._needed:
                return None
            data = b"".join(self._waiting)
            self._waiting.clear()
            self._waiting_size = 0
        self._needed = 0
        return self._unparsed + data if self._unparsed else bytes(data)

    async def _control(self, line: bytes) -> None:
        """A control line other than a message's, as nats-py handles it."""
        client = self.nc
        if OK_RE.match(line):
            return
        if (error := ERR_RE.match(line)) is not None:
            await client._process_err(error.groups()[0].decode().lower())  # noqa: SLF001
        elif PING_RE.match(line):
            await client._process_ping()  # noqa: SLF001
        elif PONG_RE.match(line):
            await client._process_pong()  # noqa: SLF001
        elif (info := INFO_RE.match(line)) is not None:
            await client._process_info(json.loads(info.groups()[0].decode()))  # noqa: SLF001
        else:
            raise ProtocolError("nats: unknown protocol")


def _message_line(buf: bytes, pos: int, eol: int) -> tuple[int, bytes, bytes, int, int]:
    """`MSG <subject> <sid> [reply] <size>` or `HMSG <subject> <sid> [reply] <header size>
    <size>`, at `pos`: (sid, subject, reply, header size, size)."""
    headed = buf[pos] == _H
    args = buf[pos + (len(_HMSG) if headed else len(_MSG)):eol].split()
    if not headed:
        args.insert(-1, b"0")
    if len(args) == 4:
        args.insert(2, b"")
    try:
        subject, sid, reply, header_size, size = args
        return int(sid), subject, reply, int(header_size), int(size)
    except ValueError:
        raise ProtocolError("nats: malformed MSG") from None


def _check_subject(subject: str) -> None:
    """nats-py's publish check of a subject (`_validate_subject`, not strict)."""
    if not subject or " " in subject or "\t" in subject or "\r" in subject or "\n" in subject:
        raise errors.BadSubjectError
