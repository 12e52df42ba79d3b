"""Events to and from the bytes stored in the log."""

import json
from typing import Any

import msgspec

from tether.domain.events import Event
from tether.domain.upcasting import EventShapeError, UnknownEventType, upcast


class EventDecodeError(ValueError):
    """A stored message that is not a current or upcastable event.

    `kind` is one of `malformed` (not JSON / not an object), `unknown-type`,
    `unknown-version` and `invalid` (fails the event's shape or constraints).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# How much of why a message does not decode a reader is told: enough to tell what is
# wrong with it; its stream sequence finds the rest (`nats stream get`).
BRIEF_REASON_CHARS = 200


def brief_reason(reason: str) -> str:
    """Why a message could not be read, cut to `BRIEF_REASON_CHARS` for a log line or a
    caller's notice (the message itself may be megabytes, and the error quotes it)."""
    if len(reason) > BRIEF_REASON_CHARS:
        return reason[:BRIEF_REASON_CHARS - 1] + "…"
    return reason


class InvalidEvent(ValueError):
    """An event built with a value its shape does not allow (a negative sequence, a
    fraction above 1, a field of the wrong type, ...): refused before it is written."""

    def __init__(self, event: Event, problem: str) -> None:
        super().__init__(f"{event.type} {event.event_id!r} is not a valid event: {problem}")
        self.event_type = event.type
        self.problem = problem


_ENCODER = msgspec.json.Encoder()
_DECODER: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    """The event's JSON, checked by reading it back: building an event checks only its
    identifiers, so this is where one that breaks its other constraints is refused
    (`InvalidEvent`)."""
    raw = _ENCODER.encode(event)
    try:
        _DECODER.decode(raw)
    except msgspec.ValidationError as error:
        raise InvalidEvent(event, str(error)) from None
    return raw


_TOO_DEEP = "not JSON this service can read: nested too deeply"


def decode_event(raw: bytes | str | dict[str, Any]) -> Event:
    """The event `raw` holds, current or upcast; anything else, however broken (not JSON,
    nested past the interpreter's stack, an unknown type), raises `EventDecodeError`, so
    a consumer has one exception to treat as an undecodable message."""
    if not isinstance(raw, dict):
        # The common case, an event in its current shape, parsed and checked in one
        # pass; anything else (an old version, a malformed message) takes the path below,
        # which upcasts or says exactly what is wrong.
        try:
            return _DECODER.decode(raw)
        except msgspec.DecodeError:  # its ValidationError too
            pass
        except RecursionError:  # nested past the stack inside an `Any` field (`data`)
            raise EventDecodeError("malformed", _TOO_DEEP) from None
    if isinstance(raw, dict):
        payload = raw
    else:
        try:
            payload = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise EventDecodeError("malformed", f"not JSON: {error}") from None
        except RecursionError:
            raise EventDecodeError("malformed", _TOO_DEEP) from None
    if not isinstance(payload, dict):
        raise EventDecodeError("malformed", f"an event is a JSON object, not {type(payload).__name__}")
    try:
        current = upcast(payload)
    except EventShapeError as error:
        kind = "unknown-type" if isinstance(error, UnknownEventType) else "unknown-version"
        raise EventDecodeError(kind, str(error)) from None
    try:
        event: Event = msgspec.convert(current, Event)
    except msgspec.ValidationError as error:
        raise EventDecodeError("invalid", str(error)) from None
    except RecursionError:
        raise EventDecodeError("malformed", _TOO_DEEP) from None
    return event
