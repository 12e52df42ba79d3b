"""The events of steering: a parent's message to its running child
(`run.message_sent`), and its receipts (`run.message_delivered`,
`run.message_consumed`). Exported by `tether.domain.events` too."""

from typing import Any, Literal

from tether.domain.event_envelope import Count, EventEnvelope, tag_types
from tether.domain.ids import Identifier, check_identifier
from tether.domain.records import Record

SteeringMode = Literal["queue", "interrupt"]


class RunMessageSentData(Record, frozen=True, kw_only=True):
    """A parent's message to its running child (steering): given to the child at its next
    step boundary; with `interrupt`, the child's current model or tool call is stopped
    first (cooperatively) and the child goes on with the message. `text`, `data` or both."""

    message_id: Identifier
    mode: SteeringMode = "queue"
    text: str | None = None
    data: Any = None

    def __post_init__(self) -> None:
        check_identifier(self.message_id, "message id")


class RunMessageReceiptData(Record, frozen=True, kw_only=True):
    """A steering message reached the child (`run.message_delivered`: the runner holding
    the run handed it over) or was taken in (`run.message_consumed`), in `attempt`."""

    message_id: Identifier
    attempt: Count

    def __post_init__(self) -> None:
        check_identifier(self.message_id, "message id")


class RunMessageSent(EventEnvelope, frozen=True, kw_only=True, tag="run.message_sent"):
    schema_version: Literal[1] = 1
    data: RunMessageSentData


class RunMessageDelivered(EventEnvelope, frozen=True, kw_only=True, tag="run.message_delivered"):
    schema_version: Literal[1] = 1
    data: RunMessageReceiptData


class RunMessageConsumed(EventEnvelope, frozen=True, kw_only=True, tag="run.message_consumed"):
    schema_version: Literal[1] = 1
    data: RunMessageReceiptData


tag_types(RunMessageSent, RunMessageDelivered, RunMessageConsumed)
