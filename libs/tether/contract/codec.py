"""Events to and from the bytes stored in the log."""

import json
from typing import Any

from pydantic import ValidationError

from tether.domain.events import EVENT_ADAPTER, Event
from tether.domain.upcasting import EventShapeError, UnknownEventType, upcast


class EventDecodeError(ValueError):
    """A stored message that is not a current or upcastable event.

    `kind` is one of `malformed` (not JSON / not an object), `unknown-type`,
    `unknown-version` and `invalid` (fails the model).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode_event(event: Event) -> bytes:
    return event.model_dump_json().encode()


def decode_event(raw: bytes | str | dict[str, Any]) -> Event:
    if not isinstance(raw, dict):
        # The common case, an event in its current shape, parsed and validated in one
        # pass; anything else (an old version, a malformed message) takes the path below,
        # which upcasts or says exactly what is wrong.
        try:
            return EVENT_ADAPTER.validate_json(raw)
        except ValidationError:
            pass
    if isinstance(raw, dict):
        payload = raw
    else:
        try:
            payload = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise EventDecodeError("malformed", f"not JSON: {error}") from None
    if not isinstance(payload, dict):
        raise EventDecodeError("malformed", f"an event is a JSON object, not {type(payload).__name__}")
    try:
        current = upcast(payload)
    except EventShapeError as error:
        kind = "unknown-type" if isinstance(error, UnknownEventType) else "unknown-version"
        raise EventDecodeError(kind, str(error)) from None
    try:
        return EVENT_ADAPTER.validate_python(current)
    except ValidationError as error:
        raise EventDecodeError("invalid", _first_lines(str(error))) from None


def _first_lines(text: str, limit: int = 12) -> str:
    return "\n".join(text.splitlines()[:limit])
