"""The delivery ledger of many runs in one log message: `deliveries.recorded`.

A hook handler reports the deliveries it finished within a few milliseconds of each other
in one `delivered` command. The parent records them as one message on the parent agent's
ledger subject (`Subjects.delivery_ledger`) instead of one `run.finish_delivered` on each
run's subject: one append, one acknowledgement and one message for each follower of the
log, for the whole batch.

Each entry is a run's `run.finish_delivered` as the parent would have appended it alone
(`finish_delivered`: the same event id, which names the run's life), and readers of the
whole log see it as that event (`as_events`), in the batch's place in the stream: the
fold, the projection and the reconciler take it as they take one appended to the run. A
read of one run's subject does not see it; the handler's own record of the delivery (the
deliveries bucket) is what a repeated hook is checked against there.

Only a report whose hook message id names the run's life is batched (`life_of`); one that
does not (a hook published by an earlier version) is recorded on its run, where the run
is read to decide it.
"""

from typing import Literal

import msgspec

from tether.domain.commands import DeliveredCommand
from tether.domain.event_envelope import EpochMs, ParentRef
from tether.domain.events import RunFinishDelivered, RunFinishDeliveredData, RunStatus
from tether.domain.ids import (
    EventId,
    Identifier,
    check_identifier,
    delivery_batch_id,
    derived_event_id,
    finish_id_head,
)
from tether.domain.records import Record

DELIVERIES_RECORDED = "deliveries.recorded"


class RecordedDelivery(Record, frozen=True, kw_only=True):
    """One delivered finish hook: the run (its parent's name: the agent is the batch's),
    the outcome's status, the hook's method and the id of the hook message the handler
    acknowledged."""

    parent_name: Identifier
    run_id: Identifier
    status: RunStatus
    method: Identifier
    message_id: str

    def __post_init__(self) -> None:
        check_identifier(self.parent_name, "parent name")
        check_identifier(self.run_id, "run id")
        check_identifier(self.method, "method")


class DeliveriesRecorded(Record, frozen=True, kw_only=True):
    """The ledger entries of one `delivered` command, for runs of one parent agent."""

    type: Literal["deliveries.recorded"] = "deliveries.recorded"
    schema_version: Literal[1] = 1
    event_id: EventId
    parent_agent: Identifier
    occurred_at: EpochMs
    entries: list[RecordedDelivery] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        check_identifier(self.parent_agent, "parent agent")

    def as_events(self) -> list[RunFinishDelivered]:
        """Each entry as the run's `run.finish_delivered`, as appended alone."""
        return [finish_delivered(ParentRef(agent=self.parent_agent, name=entry.parent_name),
                                 entry.run_id, entry.status, entry.method, entry.message_id,
                                 life=life, now=self.occurred_at)
                for entry in self.entries
                if (life := life_of(entry.run_id, entry.status, entry.method, entry.message_id))
                is not None]


def finish_delivered(parent: ParentRef, run_id: str, status: RunStatus, method: str,
                     message_id: str, *, life: str, now: int) -> RunFinishDelivered:
    """A run's ledger entry of a delivered finish hook in its life `life`
    (`RunState.incarnation`): its id names that life, so the fold can tell an earlier
    life's entry from this one's."""
    return RunFinishDelivered(
        event_id=derived_event_id(run_id, life, "finish_delivered", method, status),
        run_id=run_id, parent=parent, occurred_at=now, correlation_id=run_id,
        causation_id=message_id,
        data=RunFinishDeliveredData(status=status, method=method, message_id=message_id))


def life_of(run_id: str, status: str, method: str, message_id: str) -> str | None:
    """The run's life (`RunState.incarnation`) a finish hook's message id names; None when
    it names none (a hook published by an earlier version, or a retry's id alone)."""
    head = finish_id_head(run_id, status, method) + ":"
    if not message_id.startswith(head):
        return None
    life = message_id[len(head):].partition(":")[0]
    if not life or life.startswith("retry"):
        return None
    return life


def batch_of(reports: list[DeliveredCommand], *, now: int
             ) -> tuple[DeliveriesRecorded | None, list[DeliveredCommand]]:
    """The reports (of one parent agent) whose hook ids name their run's life, as one
    `deliveries.recorded`, and the others, to be recorded on their runs. No batch for
    fewer than two: one delivery is appended to its run as it always was."""
    named: list[DeliveredCommand] = []
    others: list[DeliveredCommand] = []
    for report in reports:
        life = life_of(report.run_id, report.status, report.method, report.message_id)
        (named if life else others).append(report)
    if len(named) < 2:
        return None, reports
    agent = named[0].parent.agent
    batch = DeliveriesRecorded(
        event_id=delivery_batch_id(agent, [f"{report.parent.name}/{report.method}/"
                                           f"{report.message_id}" for report in named]),
        parent_agent=agent, occurred_at=now,
        entries=[RecordedDelivery(parent_name=report.parent.name, run_id=report.run_id,
                                  status=report.status, method=report.method,
                                  message_id=report.message_id) for report in named])
    return batch, others


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(DeliveriesRecorded)


def encode_batch(batch: DeliveriesRecorded) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(raw: bytes) -> DeliveriesRecorded:
    """Raises `msgspec.DecodeError` (its `ValidationError` too) for anything else."""
    return _DECODER.decode(raw)
