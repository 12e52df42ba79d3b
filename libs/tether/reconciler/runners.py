"""Talking to the child-runners: inspect a child, cancel a child, and say what happened.

Every runner of an agent type subscribes to that type's inspect and cancel subjects; the
one holding the run answers with its record, the others with "no record". An inspect
therefore collects answers until one has a record or the timeout passes.
"""

import json
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from faststream.nats import NatsBroker
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tether.adapters.requests import scatter
from tether.contract.messages import (
    CancelReply,
    CancelSignal,
    ChildInspectReply,
    ChildInspectRequest,
    ChildRecord,
    ObservabilityEvent,
)
from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState
from tether.ports import SYSTEM_CLOCK


@dataclass(frozen=True)
class Inspection:
    """`found`: a runner holds the child; `unknown`: runners answered, none holds it yet
    (null: keep watching); `silent`: no runner answered; `failed`: the request failed."""

    outcome: Literal["found", "unknown", "silent", "failed"]
    record: ChildRecord | None = None
    elapsed_ms: int = 0
    error: str | None = None


class ChildControl:
    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects

    async def inspect(self, state: RunState, timeout_s: float) -> Inspection:
        started = time.monotonic()
        answered = False
        request = ChildInspectRequest(run_id=state.run_id, parent=state.parent)
        try:
            async with aclosing(scatter(self._nc, self._subjects.inspect_child(state.agent_type),
                                        request.model_dump_json().encode(),
                                        within_s=timeout_s)) as answers:
                async for data in answers:
                    answered = True
                    reply = ChildInspectReply.model_validate_json(data)
                    if reply.record is not None:
                        return Inspection("found", reply.record, _ms_since(started))
        except Exception as error:  # noqa: BLE001 - an inspection that fails is an answer
            return Inspection("failed", None, _ms_since(started), f"{type(error).__name__}: {error}")
        return Inspection("unknown" if answered else "silent", None, _ms_since(started))

    async def signal_cancel(self, state: RunState, reason: str) -> None:
        """Tell the runner holding the child to stop it, without waiting for it: the
        request is in the log already, and the runner also finds it there."""
        signal = CancelSignal(run_id=state.run_id, parent=state.parent, reason=reason)
        await self._nc.publish(self._subjects.cancel_signal(state.agent_type),
                               signal.model_dump_json().encode())

    async def cancel(self, state: RunState, reason: str, grace_s: float) -> bool:
        """Ask the runners to stop the child; True when it is known not to be running."""
        signal = CancelSignal(run_id=state.run_id, parent=state.parent, reason=reason)
        subject = self._subjects.cancel_signal(state.agent_type)
        try:
            response = await self._nc.request(subject, signal.model_dump_json().encode(),
                                              timeout=grace_s + 1.0)
        except NoRespondersError:
            return True  # no runner is up: the child runs nowhere
        except NatsTimeout:
            return True  # runners are up and none holds the run: it is queued, not running
        reply = CancelReply.model_validate_json(response.data)
        return reply.stopped or not reply.had_run


async def awaiter_present(nc: NATS, subjects: Subjects, state: RunState,
                          timeout_s: float) -> bool:
    """Whether the application awaiting the run still answers for it (docs/recovery.md).

    Its subscription lives as long as its connection, so "no responders" is the server
    saying the awaiting side is gone; an awaiter that is slow to answer is still there.
    """
    try:
        await nc.request(subjects.awaiter(state.parent, state.run_id), b"", timeout=timeout_s)
    except NoRespondersError:
        return False
    except (NatsTimeout, NatsError, OSError):
        return True  # not known to be gone: asked again at the next check
    return True


class Observability:
    """Typed events for operators: a core NATS message (published through the
    reconciler's faststream broker) and a structured log line each."""

    def __init__(self, broker: NatsBroker, subjects: Subjects, logger) -> None:
        self._broker, self._subjects, self._logger = broker, subjects, logger

    async def emit(self, event_type: str, run_id: str, parent: ParentRef,
                   reason: str | None = None, **details: object) -> None:
        event = ObservabilityEvent(type=event_type, run_id=run_id, parent=parent, reason=reason,
                                   at=SYSTEM_CLOCK.now(), details=details)
        self._logger.info(event_type, run_id=run_id, parent=f"{parent.agent}/{parent.name}",
                          reason=reason, **details)
        await self._broker.publish(json.dumps(event.model_dump(mode="json")).encode(),
                                   self._subjects.observability(event_type, parent))


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
