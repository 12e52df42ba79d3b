"""A stored message too large for a `history` reply whole, sent in parts and joined again
by the client; and the wire shapes that keep clients and parents from before parts
working."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.client.errors import RequestFailed
from tether.client.run_events import whole_data
from tether.contract.messages import HistoryReply, StoredMessage
from tether.domain.commands import HistoryQuery
from tether.domain.events import ParentRef
from tether.domain.history_parts import part_end, quoted_size

PARENT = ParentRef(agent="AliceBot", name="user-1")


def parts_of(data: bytes, budget: int) -> list[bytes]:
    parts, offset = [], 0
    while offset < len(data):
        end = part_end(data, offset, budget)
        parts.append(data[offset:end])
        offset = end
    return parts


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=400), budget=st.integers(16, 120))
def test_parts_decode_on_their_own_fit_the_budget_and_join_to_the_message(text, budget):
    data = text.encode()
    parts = parts_of(data, budget)
    assert b"".join(parts) == data
    for part in parts:
        assert quoted_size(part.decode()) <= budget  # (strict: no part cuts a character)


def test_an_events_quotes_and_control_characters_take_more_parts_than_its_bytes_say():
    event = json.dumps({"output": '"\\\n' * 1000}).encode()  # each character escaped once
    parts = parts_of(event, 1024)
    assert b"".join(parts) == event
    assert all(quoted_size(part.decode()) <= 1024 for part in parts)
    assert len(parts) > len(event) // 1024 + 1


def test_bytes_that_are_not_utf8_are_still_cut_into_parts_that_end():
    data = b"\x80" * 100 + b"\xff" * 100
    assert b"".join(parts_of(data, 32)) == data


def test_a_budget_smaller_than_one_character_still_moves_on_by_one_character():
    data = "\x1fé".encode()  # quoted: "\u001f" and "é", each over four bytes
    assert parts_of(data, 4) == [b"\x1f", "é".encode()]


@pytest.mark.parametrize("offset", [-1, 10, 11])
def test_an_offset_outside_the_message_is_refused_naming_data_offset(offset):
    with pytest.raises(ValueError, match=f"data_offset {offset} is not within the message's "
                                         "10 bytes"):
        part_end(b"0123456789", offset, 64)


def test_a_query_and_a_message_without_parts_are_written_as_before_parts():
    """Parents and clients from before parts refuse fields they do not know."""
    assert "data_offset" not in json.loads(HistoryQuery(parent=PARENT).model_dump_json())
    assert json.loads(HistoryQuery(parent=PARENT, data_offset=7).model_dump_json())[
        "data_offset"] == 7
    whole = json.loads(StoredMessage(seq=1, subject="s", data="{}").model_dump_json())
    assert set(whole) == {"seq", "subject", "data", "pending"}
    part = StoredMessage(seq=1, subject="s", data="{", data_size=2, data_end=1)
    assert json.loads(part.model_dump_json())["data_end"] == 1


def _served(data: bytes, budget: int):
    """A parent's answers for the rest of one message, as `history` gives them."""
    asked: list[int] = []

    async def ask(seq: int, data_offset: int) -> HistoryReply:
        asked.append(data_offset)
        end = part_end(data, data_offset, budget)
        return HistoryReply(messages=[StoredMessage(
            seq=seq, subject="s", data=data[data_offset:end].decode(), data_size=len(data),
            data_end=end)])

    first_end = part_end(data, 0, budget)
    first = StoredMessage(seq=5, subject="s", data=data[:first_end].decode(),
                          data_size=len(data), data_end=first_end)
    return first, ask, asked


async def test_a_client_joins_a_message_sent_in_parts():
    data = json.dumps({"output": "é\"" * 300}).encode()
    first, ask, asked = _served(data, 100)
    assert await whole_data(first, ask) == data
    assert len(asked) == len(parts_of(data, 100)) - 1


async def test_a_whole_message_costs_no_further_request():
    async def ask(seq: int, data_offset: int) -> HistoryReply:
        raise AssertionError("asked")

    assert await whole_data(StoredMessage(seq=1, subject="s", data="{}"), ask) == b"{}"


async def test_a_reply_without_the_rest_of_the_message_fails_the_read_saying_which():
    first, _, _ = _served(b"x" * 100, 40)

    async def another_message(seq: int, data_offset: int) -> HistoryReply:
        return HistoryReply(messages=[StoredMessage(seq=seq + 1, subject="s", data="{}")])

    with pytest.raises(RequestFailed, match=f"the message at seq 5 of s from byte "
                                            f"{first.data_end} did not carry it"):
        await whole_data(first, another_message)
