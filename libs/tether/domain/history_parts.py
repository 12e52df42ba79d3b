"""How much of a stored message a `history` reply carries.

A reply quotes each message's data as a JSON string, which can take up to six times its
bytes (a control character becomes `\\u00XX`; an event's own `\\"` becomes `\\\\\\"`), so a
message that the stream held within NATS's max payload may not fit in a reply whole. Such
a message is sent in parts, each cut at the start of a UTF-8 character so that every part
decodes on its own and the parts' bytes join up to the message's.
"""

from pydantic_core import to_json


def quoted_size(text: str) -> int:
    """The bytes `text` takes as a JSON string in a reply."""
    return len(to_json(text))


def part_end(data: bytes, offset: int, budget: int) -> int:
    """Where the part of `data` that starts at `offset` ends: as much as fits in `budget`
    bytes once decoded and quoted, cut at a character's start; at least one character,
    so that reading part after part always ends."""
    if not 0 <= offset < len(data):
        raise ValueError(f"data_offset {offset} is not within the message's "
                         f"{len(data)} bytes")
    smallest = _first_character_end(data, offset)
    end = min(len(data), offset + budget)
    while True:
        end = max(_character_start(data, end), smallest)
        size = quoted_size(data[offset:end].decode(errors="replace"))
        if size <= budget or end == smallest:
            return end
        # Shrink by the measured growth; the margin makes the next try fit most often.
        end = offset + (end - offset) * budget // size - 8


# A UTF-8 character is one lead byte and at most three continuation bytes (0b10xxxxxx).
# Bytes that are not UTF-8 decode as replacement characters wherever they are cut.
def _is_continuation(byte: int) -> bool:
    return 0x80 <= byte < 0xC0


def _character_start(data: bytes, end: int) -> int:
    """`end`, moved back to the start of the character it falls within."""
    for start in range(end, max(end - 4, -1), -1):
        if start >= len(data) or not _is_continuation(data[start]):
            return start
    return end


def _first_character_end(data: bytes, offset: int) -> int:
    last = min(offset + 4, len(data))
    for end in range(offset + 1, last):
        if not _is_continuation(data[end]):
            return end
    return last
