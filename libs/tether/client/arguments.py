"""The client's arguments checked before anything is sent or subscribed: a run command
(`build_run_command`), durations, expiries, lists of ids and a fork's request, each
error naming the argument."""

import math
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from tether.domain.commands import MAX_EXPIRES_IN_MS, ForkRequest, RunCommand
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef, RunRef
from tether.domain.ids import check_identifier


def build_run_command(parent: ParentRef, agent_type: str, input: Any, *, run_id: str | None,
                      parent_tool_call_id: str | None, display_order: int | None,
                      display: str | None,
                      detached: bool | dict[str, Any] | DetachedOptions,
                      started_by: RunRef | None = None,
                      expires_in: float | None = None, max_tokens: int | None = None,
                      max_cost: float | None = None, turn: int | None = None,
                      fork: ForkRequest | None = None, rewind: int | None = None) -> RunCommand:
    """The run command, with every argument checked here rather than by a rejection."""
    check_identifier(agent_type, "agent type")
    run_id = check_identifier(run_id, "run id") if run_id is not None else new_run_id()
    if isinstance(input, BaseModel):
        input = input.model_dump(mode="json")
    if input is None:
        input = {}
    if not isinstance(input, dict):
        raise TypeError(f"the input of a run is a JSON object, not {type(input).__name__}")
    if isinstance(detached, dict) and detached.get("on_finish") is not None:
        check_identifier(detached["on_finish"], "on_finish method")
    try:
        command = RunCommand(run_id=run_id, parent=parent, agent_type=agent_type, input=input,
                             parent_tool_call_id=parent_tool_call_id,
                             display_order=display_order, display=display, detached=detached,
                             started_by=started_by, expires_in_ms=expires_in_ms(expires_in),
                             max_tokens=max_tokens, max_cost=max_cost, turn=turn, fork=fork,
                             rewind=rewind)
    except ValidationError as error:
        raise ValueError(f"invalid run request: {first_error(error)}") from None
    if (mixed := command.mixed()) is not None:
        raise ValueError(f"invalid run request: {mixed}")
    return command


def expires_in_ms(expires_in: float | None) -> int | None:
    """A command's `expires_in_ms` from seconds; a ValueError names the argument."""
    if expires_in is None:
        return None
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float):
        raise TypeError(f"expires_in is a number of seconds, not {type(expires_in).__name__}")
    if not math.isfinite(expires_in):
        raise ValueError(f"expires_in must be more than 0 and at most "
                         f"{MAX_EXPIRES_IN_MS // 1000} seconds, not {expires_in!r}")
    ms = round(expires_in * 1000)
    if not 0 < ms <= MAX_EXPIRES_IN_MS:
        raise ValueError(f"expires_in must be more than 0 and at most "
                         f"{MAX_EXPIRES_IN_MS // 1000} seconds, not {expires_in!r}")
    return ms


def check_seconds(value: Any, name: str, *, none_allowed: bool = True) -> float | None:
    """A duration argument (`timeout`, ...) checked before anything is sent or subscribed:
    a positive finite number of seconds, or None where that means no limit."""
    if value is None and none_allowed:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        accepted = "a number of seconds" + (" or None" if none_allowed else "")
        raise TypeError(f"{name} is {accepted}, not {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        none = " (or None: no limit)" if none_allowed else ""
        raise ValueError(f"{name} must be a positive finite number of seconds{none}, "
                         f"not {value!r}")
    return float(value)


def ids_of(ids: Iterable[str], name: str) -> list[str]:
    """A list argument of run or tool call ids; a plain string is refused, not split into
    characters."""
    if isinstance(ids, str | bytes):
        raise TypeError(f"{name} is a list of ids, not a string: {name}=[{ids!r}]")
    return list(ids)


def fork_request(run_id: str, point: str, overrides: dict[str, Any] | None) -> ForkRequest:
    try:
        return ForkRequest(run_id=run_id, at=point, overrides=overrides or {})
    except ValidationError as error:
        raise ValueError(f"invalid fork request: {first_error(error)}") from None


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex}"


def first_error(error: ValidationError) -> str:
    problem = error.errors()[0]
    where = ".".join(str(part) for part in problem["loc"])
    return f"{where}: {problem['msg']}" if where else problem["msg"]
