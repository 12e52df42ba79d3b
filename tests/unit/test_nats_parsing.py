"""The shortcuts taken past nats-py give nats-py's answers: the header parse and the
publish command of the services' fast client (`nats_fastpath`), and the delivery position
read off a delivery's reply subject."""

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from tether.adapters.nats_fastpath import BadHeaderError, FastClient, supported
from tether.adapters.pull import delivery_of

fast_path = pytest.mark.skipif(not supported(), reason="an untested nats-py: no fast path")

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
    assert position == (expected.sequence.stream, expected.num_delivered, expected.num_pending)
    assert (position.stream_seq, position.pending) == (4711, 93)


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
