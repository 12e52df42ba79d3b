"""The shortcuts taken past nats-py give nats-py's answers: the protocol parse, the header
parse and the publish command of the services' fast client (`nats_fastpath`), and the
delivery position read off a delivery's reply subject."""

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ProtocolError
from nats.js import api
from nats.protocol.parser import Parser

from tether.adapters.event_log import log_time_ms
from tether.adapters.nats_fastpath import BadHeaderError, FastClient, FastParser
from tether.adapters.pull import delivery_of

fast_path = pytest.mark.usefixtures("tested_nats_py")

HEADER_BLOCKS = [
    b"Nats-Msg-Id: 3f1c2a8e-1b2c:running:1\r\nNats-Expected-Last-Subject-Sequence: 12\r\n\r\n",
    b"Nats-Msg-Id:no-space\r\nX:\tTabbed value  \r\n\r\n",
    b"Bad Name: skipped\r\n: no name\r\nno colon at all\r\n\xff\xfe: not ascii\r\n",
    b"Value: caf\xc3\xa9 \xff broken utf-8\r\nEmpty:\r\nDup: 1\r\nDup: 2\r\n",
    b"",
]


@fast_path
@pytest.mark.parametrize("raw", HEADER_BLOCKS)
def test_headers_parse_as_nats_py_parses_them(raw: bytes) -> None:
    assert FastClient._parse_header_lines(raw) == Client._parse_header_lines(raw)


@pytest.mark.parametrize("reply", [
    "$JS.ACK.EVENTS.cons.1.4711.12.1700000000000000000.93",  # the short form
    "$JS.ACK.EVENTS.cons.3.4711.12.1700000000000000000.93",  # a third delivery
    "$JS.ACK.hub.ACCHASH.EVENTS.cons.1.4711.12.1700000000000000000.93.rnd",  # domain, hash
    "$JS.ACK._.ACCHASH.EVENTS.cons.2.4711.12.1700000000000000000.93.rnd",
])
def test_the_delivery_position_is_what_nats_py_reads_from_the_reply(reply: str) -> None:
    msg = Msg(None, subject="tether.evt.a.b.r1", reply=reply, data=b"{}")
    expected = Msg(None, subject="tether.evt.a.b.r1", reply=reply, data=b"{}").metadata
    position = delivery_of(msg)
    assert position == (expected.sequence.stream, expected.num_delivered, expected.num_pending,
                        int(expected.timestamp.timestamp() * 1000))
    assert (position.stream_seq, position.pending, position.logged_at) == (
        4711, 93, 1_700_000_000_000)


@pytest.mark.parametrize(("stamp", "expected"), [
    ("2023-11-14T22:13:20Z", 1_700_000_000_000),
    ("2023-11-14T22:13:20.5Z", 1_700_000_000_500),
    ("2023-11-14T22:13:20.123456789Z", 1_700_000_000_123),
    ("2023-11-14T23:13:20.25+01:00", 1_700_000_000_250),
    (None, None),
])
def test_a_stored_messages_time_stamp_reads_as_epoch_milliseconds(stamp, expected) -> None:
    assert log_time_ms(stamp) == expected


HEADERS_TO_SEND = [
    {"Nats-Msg-Id": "r1:running:1", "Nats-Expected-Last-Subject-Sequence": "12",
     "Nats-Expected-Stream": "TETHER_EVENTS"},
    {" Padded ": "  value  ", "": "no name", "Line": "one\r\ntwo\nthree"},
    {"Value": "café ünïcode"},
    # nats-py's own names (key-value updates, JetStream publishes) are str enums.
    {api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "7", api.Header.EXPECTED_STREAM: "KV_X"},
    {api.Header.MSG_ID: "twice"},
    {},
    None,
]


async def sent_by(client: Client, headers: dict[str, str] | None) -> list[bytes]:
    sent: list[bytes] = []

    async def capture(command: bytes, priority: bool = False) -> None:
        sent.append(bytes(command))

    client._send_command = capture
    client._flush_queue = None
    payload = b'{"x": 1}'
    await client._send_publish("tether.evt.a.b.r1", "_INBOX.x.7", payload, len(payload), headers)
    return sent


@fast_path
@pytest.mark.parametrize("headers", HEADERS_TO_SEND)
async def test_a_publish_sends_the_bytes_nats_py_sends(headers) -> None:
    ours, theirs = FastClient(), Client()
    for _ in range(2):  # the second time with the names already checked
        sent = await sent_by(ours, headers)
        assert len(sent) == 1 and sent == await sent_by(theirs, headers)
    assert ours.stats == theirs.stats


@fast_path
@pytest.mark.parametrize("name", ["Bad Name", "Colon:", "Ünïcode"])
async def test_a_header_name_nats_py_refuses_is_refused(name: str) -> None:
    for client in (FastClient(), Client()):
        with pytest.raises(BadHeaderError):
            await sent_by(client, {"Nats-Msg-Id": "1", name: "x"})


class Recorder:
    """What a parser asks of the client, in order; `take` hands nothing on, so every
    message reaches `_process_msg`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def take(self, *message) -> bool:
        return False

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        self.calls.append(("msg", sid, bytes(subject), bytes(reply), bytes(data),
                           None if headers is None else bytes(headers)))

    async def _process_err(self, error: str) -> None:
        self.calls.append(("err", error))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info: dict) -> None:
        self.calls.append(("info", info))


def hmsg(subject: bytes, sid: int, reply: bytes | None, headers: bytes, payload: bytes) -> bytes:
    fields = b" ".join(x for x in (subject, str(sid).encode(), reply) if x)
    return b"HMSG %s %d %d\r\n%s%s\r\n" % (fields, len(headers), len(headers) + len(payload),
                                          headers, payload)


def msg(subject: bytes, sid: int, reply: bytes | None, payload: bytes) -> bytes:
    fields = b" ".join(x for x in (subject, str(sid).encode(), reply) if x)
    return b"MSG %s %d\r\n%s\r\n" % (fields, len(payload), payload)


EVENT_HEADERS = b"NATS/1.0\r\nNats-Msg-Id: r1:abc:ms:0\r\n\r\n"
PROTOCOL = b"".join([
    b'INFO {"server_id":"x","max_payload":1048576}\r\n',
    msg(b"_INBOX.a.1", 3, None, b'{"stream":"TETHER_EVENTS","seq":7}'),
    hmsg(b"tether.evt.a.b.r1", 7, b"$JS.ACK.TETHER_EVENTS.c.1.7.7.1700000000000000000.0",
         EVENT_HEADERS, b'{"type":"run.milestone"}'),
    b"PING\r\n",
    msg(b"tether.cmd.run", 12, b"_INBOX.reply.9", b"x" * 100_000),  # longer than a read
    b"+OK\r\n",
    hmsg(b"_INBOX.b.2", 4, None, b"NATS/1.0 100 Idle Heartbeat\r\n\r\n", b""),
    msg(b"empty", 5, None, b""),
    b"PONG\r\n",
    hmsg(b"tether.evt.a.b.r2", 7, b"$JS.ACK.TETHER_EVENTS.c.1.8.8.1700000000000000000.0",
         b"NATS/1.0\r\nBin: \xff\r\n\r\n", b"\r\n\x00payload with CRLF\r\n"),
    b"-ERR 'Stale Connection'\r\n",
])


async def parsed(parser_class, chunks: list[bytes]) -> list[tuple]:
    client = Recorder()
    parser = parser_class(client)
    for chunk in chunks:
        await parser.parse(chunk)
    return client.calls


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


@fast_path
@pytest.mark.parametrize("size", [1, 2, 7, 64, 4096, 32768, len(PROTOCOL)])
async def test_the_fast_parser_makes_the_calls_nats_pys_makes(size: int) -> None:
    chunks = split_every(PROTOCOL, size)
    expected = await parsed(Parser, chunks)
    assert [call[0] for call in expected] == [
        "info", "msg", "msg", "ping", "msg", "msg", "msg", "pong", "msg", "err"]
    assert await parsed(FastParser, chunks) == expected


@fast_path
@pytest.mark.parametrize("garbage", [b"BOGUS line\r\n", b"MSG subject 1 notanumber\r\nx\r\n",
                                     b"HMSG subject 1 2\r\n"])
async def test_the_fast_parser_refuses_what_is_not_the_protocol(garbage: bytes) -> None:
    parser = FastParser(Recorder())
    await parser.parse(msg(b"ok", 1, None, b"fine"))
    with pytest.raises(ProtocolError):
        await parser.parse(garbage)


@fast_path
async def test_what_was_read_before_a_reset_is_not_parsed_after_it() -> None:
    """A reconnect resets the parser while it waits on the client: the rest of the old
    connection's bytes are dropped, and the new connection's parse from a clean start."""
    class Resetting(Recorder):
        async def _process_ping(self) -> None:
            await super()._process_ping()
            parser.reset()

    client = Resetting()
    parser = FastParser(client)
    await parser.parse(msg(b"before", 1, None, b"a") + b"PING\r\n" + msg(b"stale", 1, None, b"b")
                       + b"MSG partial 1 10\r\n")
    await parser.parse(msg(b"after", 2, None, b"c"))
    assert [call[:3] for call in client.calls] == [("msg", 1, b"before"), ("ping",),
                                                   ("msg", 2, b"after")]


async def published_by(client: Client, subject: str, reply: str, payload: bytes,
                       headers: dict[str, str] | None) -> list[bytes] | type[Exception]:
    """What `publish` sends on a client that buffers for a reconnection, or what it raises."""
    sent: list[bytes] = []

    async def capture(command: bytes, priority: bool = False) -> None:
        sent.append(bytes(command))

    client._send_command = capture
    client._flush_queue = None
    client._max_pending_size = 1024
    client._max_payload = 512
    try:
        await client.publish(subject, payload, reply=reply, headers=headers)
    except Exception as error:  # noqa: BLE001 - the error is what is compared
        return type(error)
    return sent


@fast_path
@pytest.mark.parametrize("subject, reply, payload", [
    ("tether.evt.a.b.r1", "", b"{}"),
    ("tether.evt.a.b.r1", "_INBOX.x.7", b"{}"),
    ("", "", b"{}"),
    ("bad subject", "", b"{}"),
    ("tab\tbed", "", b"{}"),
    ("line\rbreak", "", b"{}"),
    ("line\nbreak", "", b"{}"),
    ("tether.evt", "bad reply", b"{}"),
    ("tether.evt", "reply\r\nPUB x 1", b"{}"),
    ("non\u00a0breaking.ünïcode", "", b"{}"),  # only ASCII whitespace is refused
    ("tether.evt", "", b"x" * 513),  # over the server's max payload
    ("tether.evt", "", b"x" * 1025),  # over what is kept for a reconnection
])
@pytest.mark.parametrize("headers", [None, {"Nats-Msg-Id": "m1"}])
async def test_a_publish_is_refused_or_sent_as_nats_py_refuses_or_sends_it(
        subject: str, reply: str, payload: bytes, headers) -> None:
    ours = await published_by(FastClient(), subject, reply, payload, headers)
    assert ours == await published_by(Client(), subject, reply, payload, headers)


class FailingOnce(Recorder):
    """A client whose handler fails on the first message to `fail_on`."""

    def __init__(self, fail_on: bytes) -> None:
        super().__init__()
        self.fail_on = fail_on

    async def _process_msg(self, sid, subject, reply, data, headers) -> None:
        await super()._process_msg(sid, subject, reply, data, headers)
        if bytes(subject) == self.fail_on:
            self.fail_on = b""
            raise RuntimeError("the handler failed")


@fast_path
@pytest.mark.parametrize("size", [1, 64, len(PROTOCOL)])
async def test_after_a_handler_fails_parsing_goes_on_as_nats_pys_does(size: int) -> None:
    """The message handed on counts as read, as in nats-py's parser: what follows it is
    parsed next, nothing twice."""
    async def calls(parser_class) -> list[tuple]:
        client = FailingOnce(b"tether.evt.a.b.r1")
        parser = parser_class(client)
        failures = 0
        for chunk in split_every(PROTOCOL, size):
            try:
                await parser.parse(chunk)
            except RuntimeError:
                failures += 1
        assert failures == 1
        return client.calls

    assert await calls(FastParser) == await calls(Parser)
