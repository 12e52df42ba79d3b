"""What clients ask of a parent: imperative commands and request/reply queries.

Each command travels on its own subject (`tether.cmd.run`, ...), and the payload may
leave `type` out; `parse_command` fills it in from the subject so the same union serves
payloads from any NATS client.
"""

from typing import Annotated, Any, Literal, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from tether.domain.detached_options import DetachedOptions
from tether.domain.event_envelope import EpochMs
from tether.domain.events import ParentRef, RunRef, RunStatus
from tether.domain.ids import Identifier
from tether.domain.recorded import ForkPoint
from tether.domain.steering_events import SteeringMode


class Model(BaseModel):
    """A command, a query or another message a client or a service writes: checked as
    it is made and as it is read."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _detached_kind(value: Any) -> str:
    return "bool" if isinstance(value, bool) else "DetachedOptions"


# A command's expiry: how long after the commands stream stored it a parent may still
# apply it (`expires_in_ms`). Later, it is not applied (a run request is refused
# `expired`): a command sent while no parent ran does not act, much later, on a world
# newer than itself. Both ends of the interval are the broker's clock (the stream's
# stamp and `BrokerClock`), so no machine's wall clock moves it. None: no expiry.
MAX_EXPIRES_IN_MS = 7 * 24 * 3_600_000
ExpiresIn = Annotated[int, Field(gt=0, le=MAX_EXPIRES_IN_MS)] | None


def overdue_ms(payload: Any, stored_at: int, now: int) -> int | None:
    """By how many ms a command handled at `now` (the broker's time, epoch ms) is past
    its expiry, from the stream's stamp `stored_at`; None when it has none or is within
    it. `payload` is the command as read (an object, or bytes that are not one); a
    malformed `expires_in_ms` is left to the command's own validation."""
    expires_in = payload.get("expires_in_ms") if isinstance(payload, dict) else None
    if type(expires_in) is not int or expires_in <= 0:
        return None
    late = now - stored_at - expires_in
    return late if late > 0 else None


# `detached` is a flag or options; an error names the form it was read as.
Detached = Annotated[Annotated[bool, Tag("bool")] | Annotated[DetachedOptions, Tag("DetachedOptions")],
                     Discriminator(_detached_kind)]


class ForkRequest(Model):
    """A fork of the run `run_id` of the same parent at `at` (`step:<n>`,
    `milestone:<name>`, `seq:<n>`): the new run reuses what it had recorded by then
    (`tether.domain.forks`). `overrides`: what the fork changes in how its agent runs, as
    the agent's `overrides_model` reads them (a model agent: instructions, model,
    max_steps)."""

    run_id: Identifier
    at: str = Field(min_length=1, max_length=256)
    overrides: dict[str, Any] = Field(default_factory=dict)

    @field_validator("at")
    @classmethod
    def _a_point(cls, at: str) -> str:
        ForkPoint.parse(at)
        return at


class RunCommand(Model):
    type: Literal["run"] = "run"
    run_id: Identifier
    parent: ParentRef
    agent_type: Identifier
    input: dict[str, Any] = Field(default_factory=dict)
    parent_tool_call_id: str | None = Field(default=None, max_length=256)
    display_order: int | None = None
    display: str | None = Field(default=None, max_length=256)
    detached: Detached = False
    # The run that starts this one, when a child delegates (`RunContext.run_agent_tool`):
    # `parent` must be that run's name as a parent (`RunState.as_parent`).
    started_by: RunRef | None = None
    expires_in_ms: ExpiresIn = None
    # A budget in model tokens and cost over the run and the runs below it (default: its
    # agent type's, else none).
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_cost: Annotated[float, Field(gt=0)] | None = None
    # A follow-up: turn `turn` (from 2) of the finished run `run_id`, with this input;
    # the same turn asked again is the same turn.
    turn: Annotated[int, Field(ge=2)] | None = None
    # A fork of another run of the parent: the new run `run_id` reuses what that run had
    # recorded by the fork point.
    fork: ForkRequest | None = None
    # A rewind of the failed run `run_id` (its `rewind`th, from 1): it goes on from its
    # last recorded step, as a new attempt of the same run; the same rewind asked again
    # is that rewind.
    rewind: Annotated[int, Field(ge=1)] | None = None

    @property
    def plain(self) -> bool:
        """A request of a new run: no follow-up, fork or rewind."""
        return self.turn is None and self.fork is None and self.rewind is None

    def mixed(self) -> str | None:
        """Why the request is not one kind of request (None: it is): a follow-up, a fork
        and a rewind are one at most. (A method the parent calls, not a validator: most
        requests are none of them, and parse faster without one.)"""
        kinds = [name for name, given in (("turn", self.turn is not None),
                                           ("fork", self.fork is not None),
                                           ("rewind", self.rewind is not None)) if given]
        if len(kinds) > 1:
            return f"{' and '.join(kinds)}: a run request is one of them at most"
        return None

    def detached_options(self) -> DetachedOptions | None:
        if self.detached is False:
            return None
        if self.detached is True:
            return DetachedOptions()
        return self.detached


class CancelCommand(Model):
    type: Literal["cancel"] = "cancel"
    run_id: Identifier
    parent: ParentRef
    expires_in_ms: ExpiresIn = None


class ClearCommand(Model):
    type: Literal["clear"] = "clear"
    parent: ParentRef
    status: list[RunStatus] | None = None
    older_than: EpochMs | None = None
    expires_in_ms: ExpiresIn = None


class ContinueCommand(Model):
    """Answers to a paused run: `run_id` of `parent`, or, with `below`, the run those run
    ids lead to down its tree (each the next one's parent, as a timeline's `waiting_path`
    shows them), so that an application answers a paused descendant through the root it
    owns, with the grants it has for that root."""

    type: Literal["continue"] = "continue"
    run_id: Identifier
    parent: ParentRef
    below: Annotated[list[Identifier], Field(max_length=16)] = Field(default_factory=list)
    approvals: list[str] = Field(default_factory=list)
    rejections: list[str] = Field(default_factory=list)
    tool_outputs: dict[str, Any] = Field(default_factory=dict)
    human_input: str | None = None
    expires_in_ms: ExpiresIn = None


# The longest steering message's text (characters); its data counts toward the
# command's size, which the parent's `TETHER_MAX_INPUT_BYTES` bounds.
MAX_STEERING_TEXT = 100_000


class SendCommand(Model):
    """A message to a running run (steering): the parent records it in the run's log
    (`run.message_sent`, once per `message_id`) and the runner holding the run hands it
    to the child at its next step boundary; `interrupt` stops the child's current model
    or tool call first. `text`, `data` or both. `below`, as for `continue`: the run ids
    down the tree from `run_id` to the run the message is for."""

    type: Literal["send"] = "send"
    run_id: Identifier
    parent: ParentRef
    below: Annotated[list[Identifier], Field(max_length=16)] = Field(default_factory=list)
    message_id: Identifier
    text: str | None = Field(default=None, min_length=1, max_length=MAX_STEERING_TEXT)
    data: Any = None
    mode: SteeringMode = "queue"
    expires_in_ms: ExpiresIn = None

    @model_validator(mode="after")
    def _says_something(self) -> "SendCommand":
        if self.text is None and self.data is None:
            raise ValueError("a message has text, data or both")
        return self


class MessageCommand(Model):
    """A user message for a conversation: the parent puts it on the conversation's chat
    (`tether.domain.chat`) as `user:<...>/<message_id>`, where the model parent of that
    conversation takes it in once. The conversation is the run `run_id` of `parent` (the
    application's parent instance that owns it); without `run_id`, `parent`'s own chat
    (the form before conversations had owners)."""

    type: Literal["message"] = "message"
    parent: ParentRef
    run_id: Identifier | None = None
    message_id: Identifier
    content: str = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    expires_in_ms: ExpiresIn = None


# How many deliveries one `delivered` command reports at most: its own and `more`'s.
MAX_DELIVERY_REPORTS = 256


class DeliveryReport(Model):
    """One delivered finish hook: the run, its outcome's status, the hook's method and the
    id of the hook message the handler acknowledged."""

    run_id: Identifier
    parent: ParentRef
    status: RunStatus
    method: Identifier
    message_id: str = Field(max_length=300)


class DeliveredCommand(Model):
    """A hook handler's acknowledgement: the parent records `run.finish_delivered`, so an
    application never needs to append to the log itself.

    `more` reports further deliveries in the same command, each recorded as if it came
    alone: a handler sends together the reports of the hooks it handled meanwhile. They
    may name other parents of the command's parent agent (the subject's permission admits
    that agent's application), and the field is written only when it has any."""

    type: Literal["delivered"] = "delivered"
    run_id: Identifier
    parent: ParentRef
    status: RunStatus
    method: Identifier
    message_id: str = Field(max_length=300)
    more: Annotated[list[DeliveryReport], Field(max_length=MAX_DELIVERY_REPORTS - 1)] = Field(
        default_factory=list)

    @model_validator(mode="after")
    def _one_parent_agent(self) -> "DeliveredCommand":
        for report in self.more:
            if report.parent.agent != self.parent.agent:
                raise ValueError(f"every report names a parent of agent {self.parent.agent!r}, "
                                 f"not {report.parent.agent!r}")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_more(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        if not self.more:
            written.pop("more", None)
        return written

    @classmethod
    def of(cls, reports: "list[DeliveryReport]") -> "DeliveredCommand":
        """One command reporting every delivery of `reports` (one parent agent's)."""
        first, *more = reports
        return cls(**dict(first), more=more)

    def reports(self) -> "list[DeliveredCommand]":
        """Every delivery the command reports, each as a command of its own (its fields
        were checked as the command was read: they are not checked again)."""
        if not self.more:
            return [self]
        # `more` is given: left out, model_construct would call its default factory through
        # pydantic's signature inspection, which costs more than the rest of a report.
        return [self.model_copy(update={"more": []}),
                *(DeliveredCommand.model_construct(**dict(report), more=[])
                  for report in self.more)]


class InspectQuery(Model):
    type: Literal["inspect"] = "inspect"
    run_id: Identifier
    parent: ParentRef


class ListCursor(Model):
    """The run a page of the list ended with: the next page is the runs after it in the
    list's order (`requested_at` newest first, then `run_id`), so runs requested since
    come before it and neither repeat nor shift the pages that follow."""

    requested_at: EpochMs
    run_id: Identifier


MAX_LIST_LIMIT = 10_000
# The list query's fields from after its first version: written only when used, so that a
# parent from before them (which refuses fields it does not know) takes a query without.
_LIST_PAGING_DEFAULTS: dict[str, Any] = {"agent_type": None, "before": None, "count": False,
                                          "waiting": None, "canceled": None}


class ListQuery(Model):
    """The parent's runs, newest first: of these statuses (None: any) and of `agent_type`
    (None: any); `before`: only those after that cursor; `count`: the reply's `total` is
    the number of runs the filters select, whatever the cursor and limit.

    `waiting`: True, only runs paused waiting for a human or for tool output; False, only
    runs not paused (None: either). `canceled`: True, only runs aborted on a cancel
    request; False, every run but those (None: either). With the statuses they tell the
    states apart that share one (an A2A task `working` or `input-required`, `canceled`
    or `failed`), so such a list is paged and counted exactly by the parent."""

    type: Literal["list"] = "list"
    parent: ParentRef
    status: list[RunStatus] | None = None
    limit: Annotated[int, Field(gt=0, le=MAX_LIST_LIMIT)] = 100
    agent_type: Identifier | None = None
    before: ListCursor | None = None
    count: bool = False
    waiting: bool | None = None
    canceled: bool | None = None

    @model_serializer(mode="wrap")
    def _without_unused_paging(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        for name, default in _LIST_PAGING_DEFAULTS.items():
            if getattr(self, name) == default:
                written.pop(name, None)
        return written


class HasRunQuery(Model):
    """`command_seq` and `command_id`: also whether the command stored at that sequence
    of the commands stream is this parent's `command_kind` command (a run request, a
    conversation's user message, or a hook handler's delivery report) with that message id (a command acknowledged as a
    duplicate of it asks, so another parent's command that carried the same id cannot
    swallow it)."""

    type: Literal["has_run"] = "has_run"
    run_id: Identifier
    parent: ParentRef
    command_seq: Annotated[int, Field(ge=1)] | None = None
    command_id: Annotated[str, Field(max_length=300)] | None = None
    command_kind: Literal["run", "message", "delivered"] = "run"


class HistoryQuery(Model):
    """Stored messages of one of the parent's feeds, for an application that may not read
    the streams itself (an account of its own, `tether.access`): its events, progress
    signals or chat, the whole parent's or one run's (`run_id`), from `start_seq`.

    `data_offset`: the rest of the message at `start_seq`, which a reply carried only in
    part (`StoredMessage.data_end`), from that byte of its data on; `limit` is then
    ignored."""

    type: Literal["history"] = "history"
    parent: ParentRef
    feed: Literal["events", "progress", "chat"] = "events"
    run_id: Identifier | None = None
    start_seq: Annotated[int, Field(ge=1)] = 1
    limit: Annotated[int, Field(ge=0, le=1000)] = 500
    data_offset: Annotated[int, Field(ge=0)] = 0

    @model_serializer(mode="wrap")
    def _without_data_offset(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Written only when used: a parent from before parts refuses fields it does not
        # know, and only a parent that sends parts is ever asked for the rest of one.
        written: dict[str, Any] = write(self)
        if self.data_offset == 0:
            written.pop("data_offset", None)
        return written


class ServeHookQuery(Model):
    """An application serves `method` of `parent_agent`: the parent registers it and
    creates (or updates) the method's durable consumer, which the application then pulls
    from. Asked on `<prefix>.rpc.serve_hook.<parent_agent>.<method>`."""

    type: Literal["serve_hook"] = "serve_hook"
    parent_agent: Identifier
    method: Identifier
    lease_ms: Annotated[int, Field(gt=0, le=3_600_000)]
    max_ack_pending: Annotated[int, Field(gt=0, le=10_000)]


class ChatNextQuery(Model):
    """A durable chat reader's next message, for an application that may not pull from
    a consumer itself (an account of its own): the parent acknowledges the messages
    `ack` names (the tokens of earlier replies), makes the reader's consumer (`durable`,
    shared by every reader of that name) if it is new, and hands over what is there now;
    with `drop`, it deletes the reader's consumer instead (after acknowledging `ack`).
    With `renew`, it only marks the messages those tokens name as still being handled
    (an in-progress acknowledgement: their ack wait starts again) and hands over nothing.
    Asked on `<prefix>.rpc.chat_next.<agent>.<name>`; with `run_id`, the reader reads
    the conversation of that run of the parent instead of the parent's own chat."""

    type: Literal["chat_next"] = "chat_next"
    parent: ParentRef
    run_id: Identifier | None = None
    durable: Identifier
    new_only: bool = False
    drop: bool = False
    ack: Annotated[list[Annotated[str, Field(max_length=512)]], Field(max_length=100)] = Field(
        default_factory=list)
    renew: Annotated[list[Annotated[str, Field(max_length=512)]],
                     Field(max_length=100)] = Field(default_factory=list)


Command = Annotated[
    RunCommand | CancelCommand | ClearCommand | ContinueCommand | DeliveredCommand
    | MessageCommand | SendCommand | InspectQuery | ListQuery | HasRunQuery | HistoryQuery | ServeHookQuery
    | ChatNextQuery,
    Field(discriminator="type"),
]
COMMAND_CLASSES = (RunCommand, CancelCommand, ClearCommand, ContinueCommand,
                   DeliveredCommand, MessageCommand, SendCommand, InspectQuery, ListQuery, HasRunQuery,
                   HistoryQuery, ServeHookQuery, ChatNextQuery)
COMMAND_ADAPTER: TypeAdapter[Command] = TypeAdapter(Command)
COMMAND_TYPES: frozenset[str] = frozenset(cls.model_fields["type"].default for cls in COMMAND_CLASSES)


@overload
def parse_command(kind: Literal["run"], payload: dict[str, Any]) -> RunCommand: ...


@overload
def parse_command(kind: str, payload: dict[str, Any]) -> Command: ...


def parse_command(kind: str, payload: dict[str, Any]) -> Command:
    """Validate `payload` as the command `kind` ("run", "cancel", ...); raises ValidationError."""
    if kind not in COMMAND_TYPES:
        raise ValueError(f"unknown command {kind!r}; expected one of {sorted(COMMAND_TYPES)}")
    if "type" in payload and payload["type"] != kind:
        raise ValueError(f"a {payload['type']!r} payload was sent as a {kind!r} command")
    return COMMAND_ADAPTER.validate_python({**payload, "type": kind})
