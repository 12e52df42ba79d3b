"""What the executions of one runner share, and what each ends with: the runner's
environment, the outcome of a work item, and what a caller may see of a child's error."""

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether.child.agent import AwaitingInput, ChildAgent
from tether.config import Settings
from tether.domain.events import ParentRef
from tether.ports import EventLog

if TYPE_CHECKING:
    from tether.child.recorder import RunRecorder
    from tether.delivery.deliverer import Deliverer

MAX_ERROR_CHARS = 500

OutcomeKind = Literal["completed", "failed", "aborted", "skipped", "released", "superseded",
                      "paused"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one work item; the runner logs one line per outcome."""

    run_id: str
    parent: ParentRef
    agent_type: str
    kind: OutcomeKind
    attempt: int
    detail: str | None = None
    duration_ms: int = 0
    # The child's exception, for the runner's log line (with its traceback); never stored.
    exception: BaseException | None = None


@dataclass(frozen=True, slots=True)
class RunnerEnvironment:
    """What every execution of one runner shares."""

    log: EventLog
    settings: Settings
    runner_id: str
    cancel_grace_s: float
    parent_client: Callable[[ParentRef], Any] | None = None
    # Delivers the hooks and notifications of what its executions record.
    deliverer: "Deliverer | None" = None


def safe_error(error: BaseException) -> str:
    """What a caller may see of a child's exception: its type and message, never a traceback."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"


def explain_validation(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in problem['loc']) or 'input'}: {problem['msg']}"
                     for problem in error.errors())


@dataclass(frozen=True, slots=True)
class ChildResult:
    """What a child's run came to: a summary and an output, or a pause."""

    summary: str
    output: Any
    pause: AwaitingInput | None = None


async def child_result(agent: ChildAgent, run_id: str, returned: Any,
                       recorder: "RunRecorder") -> ChildResult:
    """What `agent.run` returned, as the run's result: a pause (`AwaitingInput`), or the
    output (`get_output`'s, else what it returned unless that was its final text) as JSON
    and the summary (`get_summary`'s, else the final text, else the output it streamed)."""
    if isinstance(returned, AwaitingInput):
        return ChildResult(summary="", output=None, pause=returned)
    final_text = returned if isinstance(returned, str) else None
    output = None if isinstance(returned, str) else returned
    override = await agent.get_output(run_id)
    if override is not None:
        output = override
    try:
        output = to_jsonable_python(output)
    except PydanticSerializationError as error:
        raise TypeError(f"the child's output is not JSON-serialisable: {error}") from None
    summary = await agent.get_summary(run_id, output)
    if summary is None:
        summary = final_text if final_text is not None else recorder.output_text
    return ChildResult(summary=str(summary), output=output)


# An execution's token: this process's (random, drawn again in a forked child) and a
# count within it.
_PROCESS, _EXECUTIONS = os.urandom(4).hex(), itertools.count(1)


def _new_process() -> None:
    global _PROCESS, _EXECUTIONS
    _PROCESS, _EXECUTIONS = os.urandom(4).hex(), itertools.count(1)


os.register_at_fork(after_in_child=_new_process)


def execution_token() -> str:
    """Names one execution's events: two runners (or two items in one runner) that decide
    the same thing from the same history never take each other's stored event for their
    own, and a retry of one execution's append is stored once."""
    return f"{_PROCESS}{next(_EXECUTIONS):x}"
