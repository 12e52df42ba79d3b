"""What the executions of one runner share, and what each ends with: the runner's
environment, the outcome of a work item, and what a caller may see of a child's error."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nats.aio.msg import Msg
from pydantic import ValidationError

from tether.adapters.event_log import EventLog
from tether.config import Settings
from tether.domain.attempts import hold_fresh
from tether.domain.events import ParentRef

if TYPE_CHECKING:
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
    # Delivers the hooks and notifications of what its executions record (`start()`).
    deliverer: "Deliverer | None" = None


class Hold:
    """This runner's hold on one work item: when the server last surely heard of it.

    It starts when the request that brought the item was sent (the server's ack wait
    began no earlier) and moves with each in-progress acknowledgement, but only while it
    is fresh (`tether.domain.attempts.hold_fresh`): a runner that was stopped past it may
    have lost the item to another runner, and only a read of the run (`confirmed`) makes
    it fresh again.
    """

    def __init__(self, renewed_at: float, ack_wait_s: float) -> None:
        self.renewed_at, self.ack_wait_s = renewed_at, ack_wait_s

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
