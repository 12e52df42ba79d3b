"""Builders for events of one run, for tests of code that consumes Tether's log."""

import itertools
from typing import TYPE_CHECKING, Any

from tether.domain import events as ev
from tether.domain.events import Event, ParentRef

if TYPE_CHECKING:
    from tether.adapters.jetstream import EventLog


class RunEvents:
    """Events of one run with unique ids and increasing `occurred_at` (1 ms apart)."""

    def __init__(self, run_id: str, parent: ParentRef | None = None, *, start_ms: int = 1_000,
                 id_prefix: str | None = None) -> None:
        self.run_id = run_id
        self.parent = parent or ParentRef(agent="Assistant", name="user-1")
        self._clock = itertools.count(start_ms)
        self._ids = itertools.count(1)
        self._id_prefix = id_prefix or run_id
        self.milestones = 0
        self.outputs = 0

    def make(self, cls: type[Event], at: int | None = None, event_id: str | None = None,
             **data: Any) -> Event:
        data_cls = cls.model_fields["data"].annotation
        return cls(
            event_id=event_id or f"{self._id_prefix}-{next(self._ids)}",
            run_id=self.run_id,
            parent=self.parent,
            occurred_at=next(self._clock) if at is None else at,
            data=data_cls(**data),
        )

    def requested(self, agent_type: str = "Researcher", **data: Any) -> Event:
        return self.make(ev.RunRequested, agent_type=agent_type,
                         input=data.pop("input", {"query": "HTTP/3"}), **data)

    def started(self) -> Event:
        return self.make(ev.RunStarted, work_subject=f"tether.work.{self.run_id}")

    def running(self, attempt: int = 1) -> Event:
        return self.make(ev.RunRunning, attempt=attempt, runner_id="runner-1")

    def output(self, text: str) -> Event:
        self.outputs += 1
        return self.make(ev.RunOutput, index=self.outputs - 1, text=text)

    def milestone(self, name: str, data: Any = None) -> Event:
        self.milestones += 1
        return self.make(ev.RunMilestone, sequence=self.milestones - 1, name=name, data=data)

    def progress(self, fraction: float, message: str | None = None) -> Event:
        return self.make(ev.RunProgressPersisted, fraction=fraction, message=message)

    def completed(self, summary: str = "done", output: Any = None) -> Event:
        return self.make(ev.RunCompleted, summary=summary, output=output)

    def failed(self, error: str = "boom") -> Event:
        return self.make(ev.RunFailed, error=error)

    def interrupted(self, reason: str = "no-progress", child_still_running: bool = True) -> Event:
        return self.make(ev.RunInterrupted, reason=reason, error=f"interrupted: {reason}",
                         child_still_running=child_still_running)

    def cleared(self) -> Event:
        return self.make(ev.RunCleared)


async def append_finished_runs(log: "EventLog", runs: int, *, milestones: int = 2,
                               outputs: int = 3, parent: ParentRef | None = None,
                               id_prefix: str = "run") -> int:
    """Append `runs` whole runs (every third one fails); returns the events appended.

    Uses asynchronous publishes with the event id as `Nats-Msg-Id`, one run at a time.
    """
    import asyncio

    from tether.contract.codec import encode_event

    count = 0
    for i in range(runs):
        run = RunEvents(f"{id_prefix}-{i}", parent)
        events = [run.requested(input={"n": i}), run.started(), run.running()]
        events += [run.milestone(f"m{k}", {"k": k}) for k in range(milestones)]
        events += [run.output(f"chunk {k} ") for k in range(outputs)]
        events.append(run.completed(f"summary {i}", {"n": i}) if i % 3 else run.failed("nope"))
        acks = [await log.jetstream.publish_async(
            log.subjects.run_events(e.parent, e.run_id), encode_event(e),
            headers={"Nats-Msg-Id": e.event_id}) for e in events]
        await asyncio.gather(*acks)
        count += len(events)
    return count
