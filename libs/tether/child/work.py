"""What the executions of one runner share, and what each ends with: the runner's
environment, the outcome of a work item, and what a caller may see of a child's error."""

import asyncio
import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nats.aio.msg import Msg
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether.child.agent import AwaitingInput, ChildAgent
from tether.config import Settings
from tether.domain.attempts import delivered_no_earlier_than, hold_fresh
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


class StallWatch:
    """Notices the moments this process stopped running (a pause, a VM migration, a
    throttled container, `SIGSTOP`, a long GC): a timer ticks every `TICK_S`, and a tick
    that comes more than `STALL_S` late records the gap since the one before. A gap
    that is under way (the loop woke and has not ticked yet) counts too."""

    TICK_S, STALL_S, KEPT = 0.1, 0.2, 64

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._gaps: deque[tuple[float, float]] = deque(maxlen=self.KEPT)
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._last = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(self.TICK_S, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last > self.TICK_S + self.STALL_S:
            self._gaps.append((self._last, now))
        self._last = now
        self._timer = asyncio.get_running_loop().call_later(self.TICK_S, self._tick)

    def stalled_s(self, since: float, until: float) -> float:
        """How long the process was stalled between `since` and `until` (monotonic)."""
        gaps = list(self._gaps)
        if self._timer is not None and time.monotonic() - self._last > self.TICK_S + self.STALL_S:
            gaps.append((self._last, time.monotonic()))  # waking from one now
        return sum(max(0.0, min(end, until) - max(start, since)) for start, end in gaps)


class Hold:
    """This runner's hold on one work item: when the server surely last heard of it.

    It starts when the server handed the item out, at the earliest
    (`tether.domain.attempts.delivered_no_earlier_than`: its arrival, less any stall of
    this process since the request that brought it), and moves with each in-progress
    acknowledgement, but only while it is fresh (`tether.domain.attempts.hold_fresh`):
    a runner that was stopped past it may have lost the item to another runner, and only
    a read of the run (`confirmed`) makes it fresh again.
    """

    def __init__(self, renewed_at: float, ack_wait_s: float) -> None:
        self.renewed_at, self.ack_wait_s = renewed_at, ack_wait_s

    @classmethod
    def of_delivery(cls, requested_at: float, arrived_at: float, ack_wait_s: float,
                    watch: "StallWatch | None") -> "Hold":
        stalled = 0.0 if watch is None else watch.stalled_s(requested_at, arrived_at)
        return cls(delivered_no_earlier_than(requested_at, arrived_at, stalled), ack_wait_s)

    @property
    def fresh(self) -> bool:
        return hold_fresh(time.monotonic(), self.renewed_at, self.ack_wait_s)

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.renewed_at

    async def renew(self, msg: Msg) -> None:
        """An in-progress acknowledgement; the hold moves only if it was still fresh."""
        fresh, sent = self.fresh, time.monotonic()
        await msg.in_progress()
        if fresh:
            self.renewed_at = max(self.renewed_at, sent)

    def confirmed(self, sent: float) -> None:
        """A read of the run made after an acknowledgement sent at `sent` showed the
        attempt still current."""
        self.renewed_at = max(self.renewed_at, sent)


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
