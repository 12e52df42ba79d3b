"""A command as the parent's handlers take it: its payload (`Payload`), read as a JSON
object, and what is wrong with it, said in one line; a command with no run and parent to
answer on is `UnparseableCommand` (the service dead-letters it)."""

import json
from typing import Any

import msgspec
from pydantic import ValidationError

from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

# A command's JSON object, or its bytes when the service could not make one of them (the
# handler then says why).
Payload = dict[str, Any] | bytes


class UnparseableCommand(Exception):
    """A command with no valid run id and parent to answer on: it is dead-lettered."""


def json_object(payload: Payload) -> dict[str, Any]:
    """The command's JSON object; `UnparseableCommand` when it is none."""
    if isinstance(payload, dict):
        return payload  # parsed by the service already
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnparseableCommand(f"not JSON: {error}") from None
    except RecursionError:
        raise UnparseableCommand("not JSON this service can read: nested too deeply") from None
    if not isinstance(value, dict):
        raise UnparseableCommand(f"a command is a JSON object, not {type(value).__name__}")
    return value


def answerable(raw: dict[str, Any]) -> tuple[str | None, ParentRef | None]:
    """The run id and parent of a request that failed validation, when both are valid."""
    try:
        run_id = check_identifier(raw.get("run_id"), "run id")
        parent = msgspec.convert(raw.get("parent"), ParentRef)
    except ValueError:  # an InvalidIdentifier or msgspec's ValidationError
        return None, None
    return run_id, parent


def explain(error: Exception) -> str:
    """What is wrong with a command, in one line (pydantic's first five errors)."""
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}"
                         for e in error.errors()[:5])
    return str(error)
