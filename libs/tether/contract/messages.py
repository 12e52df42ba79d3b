"""Payloads that are not events: work items, signals, hooks, chat messages, RPC replies.

Each travels on a subject of `tether.contract.subjects.Subjects`; the comment on each
model names it and its deduplication id.
"""

from typing import Any, Literal

import msgspec
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer
from pydantic_core import to_json

from tether.domain.commands import Model
from tether.domain.detached_options import DetachedOptions
from tether.domain.event_envelope import Count, NonNegative
from tether.domain.events import InterruptedReason, ParentRef, RunRequested, RunStatus
from tether.domain.ids import Identifier, check_identifier
from tether.domain.records import Record
from tether.domain.run_state import RunState, as_builtins


class WorkItem(Record, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """`<prefix>.work.<agent_type>`, `Nats-Msg-Id: work:<run_id>:<why>:<dispatch>:<incarnation>`.

    It names the run; the runner reads everything else (input, budgets, what was already
    recorded) from the run's events, which are the truth. A new run's first item carries
    its `run.requested` and that event's stream sequence, so the runner starts it without
    a read: `run.running` is appended expecting that sequence, and a run that has moved
    since is read after all.
    """

    # A record, as the event it carries: written (`work_item_json`) and read
    # (`read_work_item`) once per run each. Fields a later parent adds are ignored rather
    # than refused, so that runners can be upgraded after parents. (Runners from before
    # `attempt` refuse items that carry it: upgrade them before the parents once.)
    run_id: Identifier
    parent: ParentRef
    agent_type: Identifier
    dispatch: Count = 1
    # The attempts the run had made when the item was published. On its first delivery,
    # a run that has made more was started by another item for the same dispatch (a
    # repeated request publishes a starting run's item again): this one is skipped. A
    # redelivery takes the run over, since the runner that held it is gone. None: an
    # item from an older parent, not checked.
    attempt: NonNegative | None = None
    requested: RunRequested | None = None
    requested_seq: Count | None = None

    def __post_init__(self) -> None:
        check_identifier(self.run_id, "run_id")
        check_identifier(self.agent_type, "agent_type")


_WORK_ITEM = msgspec.json.Decoder(WorkItem)


def work_item_json(item: WorkItem) -> bytes:
    return msgspec.json.encode(item)


def read_work_item(raw: bytes | str) -> WorkItem:
    """A work item from its JSON; raises `msgspec.DecodeError` (its `ValidationError` for
    one that is not a work item) saying what is wrong and where."""
    return _WORK_ITEM.decode(raw)


class CancelSignal(Model):
    """Core NATS `<prefix>.ctl.cancel.<agent_type>`: stop this run's child now.

    Only a nudge; the durable fact is the `run.cancel_requested` event, which a runner
    also checks when it picks a run up and while it heartbeats.
    """

    run_id: Identifier
    parent: ParentRef
    reason: str | None = None


class MessageSignal(Model):
    """Core NATS `<prefix>.ctl.message.<agent_type>`: this run has a steering message for
    its child. Only a nudge; the durable fact is the `run.message_sent` event, which the
    runner holding the run also looks for when it starts the child and as it heartbeats."""

    run_id: Identifier
    parent: ParentRef


class ProgressSignal(Model):
    """`<prefix>.progress.<parent_agent>.<parent_name>.<run_id>` (the stream keeps the last)."""

    run_id: Identifier
    parent: ParentRef
    fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    message: str | None = None
    phase: str | None = None
    milestone: str | None = None
    data: Any = None
    at: int


def progress_signal_json(run_id: str, parent: ParentRef, *, fraction: float | None,
                         message: str | None, phase: str | None, milestone: str | None,
                         data: Any, at: int) -> bytes:
    """`ProgressSignal(...).model_dump_json()` as bytes, for the values of a signal the
    runner checked when the child reported it (`tether.child.context.check_progress`),
    without building the model: one signal per report, where the model would cost
    more than the rest of its way to the wire (a test holds the two equal)."""
    return to_json({"run_id": run_id, "parent": {"agent": parent.agent, "name": parent.name},
                    "fraction": None if fraction is None else float(fraction),
                    "message": message, "phase": phase, "milestone": milestone, "data": data,
                    "at": at})


class RunInfo(Model):
    """What a hook or a formatter is told about the run."""

    run_id: str
    agent_type: str
    parent: ParentRef
    parent_tool_call_id: str | None = None
    display_order: int | None = None
    detached: DetachedOptions | None = None
    requested_at: int
    # The turn whose outcome this is: 1, or a follow-up's (written only then, so that an
    # application from before follow-ups reads the hooks of runs that take none).
    turn: int = 1

    @model_serializer(mode="wrap")
    def _without_first_turn(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        if self.turn == 1:
            written.pop("turn", None)
        return written

    @classmethod
    def of(cls, state: RunState) -> "RunInfo":
        return cls(run_id=state.run_id, agent_type=state.agent_type, parent=state.parent,
                   parent_tool_call_id=state.parent_tool_call_id,
                   display_order=state.display_order, detached=state.detached,
                   requested_at=state.requested_at, turn=state.turn)


class LifecycleResult(Model):
    """How a run ended."""

    status: Literal["completed", "error", "aborted", "interrupted"]
    summary: str | None = None
    output: Any = None
    error: str | None = None
    reason: InterruptedReason | None = None
    child_still_running: bool | None = None

    @classmethod
    def of(cls, state: RunState) -> "LifecycleResult":
        if state.status == "completed":
            return cls(status="completed", summary=state.summary, output=state.output)
        if state.status == "interrupted":
            return cls(status="interrupted", error=state.error, reason=state.reason,
                       child_still_running=state.child_still_running)
        if state.status in ("error", "aborted"):
            return cls(status=state.status, error=state.error)
        raise ValueError(f"a {state.status} run has no result yet")


# Set on a hook message the parent publishes for the first time for its outcome (the
# outcome's first delivery to the parent, not a retry after the lease): a handler that
# gets such a message on its first delivery knows it cannot be a repeat and need not
# read the run's delivery ledger. Without it a handler always reads the ledger.
FIRST_PUBLICATION_HEADER = "Tether-First-Publication"


class HookMessage(Model):
    """`<prefix>.hook.<parent_agent>.<method>`, `Nats-Msg-Id:
    finish:<run_id>:<status>:<incarnation>` (`finish-global:...` for the parent's global
    finish hook; `:retry<n>` added to a retry after the lease), and
    `Tether-First-Publication: 1` on a first publication."""

    method: Identifier
    run: RunInfo
    result: LifecycleResult


def hook_message_json(method: str, state: RunState, result: LifecycleResult) -> bytes:
    """`HookMessage(method=method, run=RunInfo.of(state), result=result).model_dump_json()`
    as bytes, without building the models: a detached run's writer publishes one per
    outcome, where the models cost more than the rest of its way to the wire (a test
    holds the two equal)."""
    return to_json({
        "method": method,
        "run": {"run_id": state.run_id, "agent_type": state.agent_type,
                "parent": {"agent": state.parent.agent, "name": state.parent.name},
                "parent_tool_call_id": state.parent_tool_call_id,
                "display_order": state.display_order,
                "detached": None if state.detached is None else as_builtins(state.detached),
                "requested_at": state.requested_at},
        "result": {"status": result.status, "summary": result.summary,
                   "output": result.output, "error": result.error, "reason": result.reason,
                   "child_still_running": result.child_still_running}})


class ChatMessage(Model):
    """`<prefix>.chat.<parent_agent>.<parent_name>[.<run_id>]`, `Nats-Msg-Id` = `id`:
    `detached-finish:<run_id>:<status>:<incarnation>`,
    `detached-ms:<run_id>:<name>:<incarnation>`,
    `user:<parent_agent>/<parent_name>[/<run_id>]/<message_id>` (a `message` command) or
    `reply:<run_id>:<incarnation>:<call>` (a model parent's answer): each names its
    conversation or its run's life, since the duplicate window is the stream's."""

    id: str
    role: Literal["user", "assistant"]
    content: str
    metadata: dict[str, Any]


class AgentToolSuccess(Model):
    ok: Literal[True] = True
    run_id: str
    agent_type: str
    summary: str
    output: Any = None


class AgentToolFailure(Model):
    """A failed agent tool: `retryable` only for an interrupted run that a request under
    the same run id resumes (`RunState.resumable`); one given up by a budget or a
    re-attach window, or cancelled, is not, and its error says so."""

    ok: Literal[False] = False
    run_id: str
    agent_type: str | None = None
    status: Literal["error", "aborted", "interrupted"]
    error: str
    retryable: bool
    reason: InterruptedReason | None = None
    child_still_running: bool | None = None

    @classmethod
    def of(cls, state: RunState) -> "AgentToolFailure":
        if state.status == "interrupted":
            error = state.error or "interrupted"
            if not state.resumable:
                error += (f"; run {state.run_id} was stopped and does not resume: request "
                          "it under a new run id, or clear it first")
            return cls(run_id=state.run_id, agent_type=state.agent_type, status="interrupted",
                       error=error, retryable=state.resumable, reason=state.reason,
                       child_still_running=state.child_still_running)
        if state.status not in ("error", "aborted"):
            raise ValueError(f"a {state.status} run is no failure")
        return cls(run_id=state.run_id, agent_type=state.agent_type, status=state.status,
                   error=state.error or state.status, retryable=False)


class DetachedHandle(Model):
    """What a detached `run_agent_tool` returns at once: `running` (a new run, or one
    requested again while it is open or being re-attached), or `error` with `error` when
    the request was refused. A run requested again after it ended answers with its status
    (`completed`, `error`, `aborted`, or `interrupted` for one given up that does not
    resume) and `result`, its stored outcome; its finish hook is not delivered again (a
    hook is delivered once per status)."""

    run_id: str
    agent_type: str
    status: Literal["running", "completed", "error", "aborted", "interrupted"]
    error: str | None = None
    result: AgentToolSuccess | AgentToolFailure | None = None


class MilestoneView(Model):
    sequence: int
    name: str
    data: Any = None
    at: int


class UsageView(Model):
    """Model usage: tokens, and the cost (None when a model's price is unknown)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cost: float | None = 0.0

    @classmethod
    def of_steps(cls, steps: dict[int, dict[str, Any]]) -> "UsageView":
        """The usage of a run's recorded steps (each model turn's usage and cost)."""
        total = cls()
        for step in steps.values():
            turn = step.get("turn") or {}
            usage = turn.get("usage") or {}
            if not turn:
                continue
            total = total.plus(cls(input_tokens=usage.get("input_tokens", 0),
                                   output_tokens=usage.get("output_tokens", 0),
                                   cached_tokens=usage.get("cached_tokens", 0),
                                   cost=step.get("cost")))
        return total

    def plus(self, other: "UsageView") -> "UsageView":
        inputs = self.input_tokens + other.input_tokens
        outputs = self.output_tokens + other.output_tokens
        cost = (None if self.cost is None or other.cost is None
                else round(self.cost + other.cost, 10))
        return UsageView(input_tokens=inputs, output_tokens=outputs,
                         cached_tokens=self.cached_tokens + other.cached_tokens,
                         total_tokens=inputs + outputs, cost=cost)


class RunSnapshot(Model):
    """A run as inspect and list show it. `usage` is the run's own model usage;
    `subtree_usage` (inspect only) adds that of every run it started, and theirs."""

    run_id: str
    parent: ParentRef
    agent_type: str
    status: RunStatus
    detached: bool
    parent_tool_call_id: str | None = None
    display_order: int | None = None
    display: str | None = None
    summary: str | None = None
    output: Any = None
    error: str | None = None
    reason: InterruptedReason | None = None
    child_still_running: bool | None = None
    progress: dict[str, Any] | None = None
    milestones: list[MilestoneView] = Field(default_factory=list)
    output_text: str = ""
    attempt: int = 0
    cancel_requested: bool = False
    waiting_for: str | None = None
    # The tool calls a paused run waits on (`tool_call_id`, `tool_name`, `input`, `reason`).
    pending: list[dict[str, Any]] = Field(default_factory=list)
    requested_at: int
    started_at: int | None = None
    ended_at: int | None = None
    usage: UsageView = Field(default_factory=UsageView)
    subtree_usage: UsageView | None = None
    # The run as the parent of the runs it starts (`RunState.as_parent`).
    as_parent: ParentRef | None = None
    # The version of the agent code its latest attempt ran (`run.running`).
    agent_version: str | None = None

    @classmethod
    def of(cls, state: RunState) -> "RunSnapshot":
        return cls(
            run_id=state.run_id, parent=state.parent, agent_type=state.agent_type,
            as_parent=state.as_parent(),
            status=state.status, detached=state.detached is not None,
            parent_tool_call_id=state.parent_tool_call_id, display_order=state.display_order,
            display=state.display, summary=state.summary, output=state.output,
            error=state.error, reason=state.reason, child_still_running=state.child_still_running,
            progress=as_builtins(state.progress) if state.progress else None,
            milestones=[MilestoneView(sequence=m.sequence, name=m.name, data=m.data, at=m.at)
                        for m in state.milestones],
            output_text=state.output_text, attempt=state.attempt,
            cancel_requested=state.cancel_requested_at is not None,
            waiting_for=state.paused.reason if state.paused else None,
            pending=list(state.paused.pending) if state.paused else [],
            requested_at=state.requested_at, started_at=state.started_at,
            ended_at=state.ended_at, usage=UsageView.of_steps(state.steps),
            agent_version=state.agent_version,
        )


class InspectReply(Model):
    """`<prefix>.rpc.inspect`: the run, or null when there is none for that parent."""

    run: RunSnapshot | None = None
    error: str | None = None


class ListReply(Model):
    """`total`: with a query that asked for it (`count`), the number of runs of its
    statuses and agent type, whatever its cursor and limit; written only then, so a
    client from before it takes the reply."""

    runs: list[RunSnapshot] = Field(default_factory=list)
    error: str | None = None
    total: NonNegative | None = None

    @model_serializer(mode="wrap")
    def _without_uncounted_total(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        if self.total is None:
            written.pop("total", None)
        return written


class HasRunReply(Model):
    """`command_ours`: the answer to the query's `command_seq`, when it asked."""

    has_run: bool = False
    command_ours: bool | None = None
    error: str | None = None
    # With an `error`: the requester asked too often; it may ask again after this long.
    retry_after_ms: int | None = None


class StoredMessage(Model):
    """One stored message of a feed; `pending`: how many matching ones follow it.

    A message too large for a reply once quoted in it (one near NATS's max payload) comes
    in parts: `data` is then its bytes from the query's `data_offset` up to `data_end`,
    of `data_size` in all, and a query with `data_offset` at `data_end` asks for the next
    part. Both are left out of a whole message, so a client from before parts reads every
    other message as before."""

    seq: int
    subject: str
    data: str
    pending: int = 0
    data_size: int | None = None
    data_end: int | None = None

    @model_serializer(mode="wrap")
    def _without_parts(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        written: dict[str, Any] = write(self)
        if self.data_end is None:
            written.pop("data_size", None)
            written.pop("data_end", None)
        return written

    @property
    def is_partial(self) -> bool:
        """Whether more of the message's data follows `data` (ask from `data_end`)."""
        return self.data_end is not None and self.data_end < (self.data_size or 0)


class HistoryReply(Model):
    """`<prefix>.rpc.history`: up to `limit` messages; `pending` matching ones follow the
    last, whose data may come in parts (`StoredMessage`). A query with `limit` 0 gets no
    messages and the stream's last sequence in `last_seq` (where a reader of new messages
    only starts)."""

    messages: list[StoredMessage] = Field(default_factory=list)
    pending: int = 0
    last_seq: int = 0
    error: str | None = None
    # With an `error`: the requester asked too often; it may ask again after this long.
    retry_after_ms: int | None = None


class ChatDelivery(Model):
    """One chat message handed to a durable reader; `token` acknowledges it (the next
    `chat_next` query's `ack`)."""

    seq: int
    data: str
    token: str


class ChatNextReply(Model):
    """`<prefix>.rpc.chat_next`: the reader's next message, if there is one now."""

    messages: list[ChatDelivery] = Field(default_factory=list)
    error: str | None = None


class ServeHookReply(Model):
    """`<prefix>.rpc.serve_hook`: the durable consumer to pull the method's hooks from."""

    consumer: str = ""
    error: str | None = None


# On the parent's notice that a run request found its run already there: an empty core
# message on the run's live subject (`<prefix>.live.evt.<agent>.<name>.<run_id>`), whose
# header gives the run's last stream sequence when the request found it. Unlike a
# republished event, it has no `Nats-Sequence`.
RUN_SEQUENCE_HEADER = "Tether-Run-Sequence"


class ChildRecord(Model):
    """What a runner knows of a run it holds (the child agent's own record)."""

    status: Literal["queued", "running", "waiting_for_tools", "waiting_for_human", "completed",
                    "stopped", "failed", "cancelled"]
    attempt: int = 0
    runner_id: str | None = None


class RunnerVersion(Model):
    """Core request on `<prefix>.ctl.versions.<agent_type>` from a runner that starts,
    and each runner's answer: which runner serves the agent type with which version of
    its code (`tether.agent_registry.agent_version`). A runner that finds another
    version, asking or answering, logs `agent.versions_differ`."""

    runner_id: str = Field(max_length=256)
    version: str = Field(max_length=256)


class ChildInspectRequest(Model):
    """Core request on `<prefix>.ctl.inspect.<agent_type>`; every runner answers."""

    run_id: Identifier
    parent: ParentRef


class ChildInspectReply(Model):
    """None means "no record yet": keep watching within the budget, never a failure."""

    record: ChildRecord | None = None


class CancelReply(Model):
    """A runner's answer to a CancelSignal sent as a request: did it hold the run, and
    did the child stop within the grace period."""

    had_run: bool
    stopped: bool


class ObservabilityEvent(Model):
    """Core `<prefix>.obs.<parent_agent>.<parent_name>.agent_tool.<event>` (with ':' as
    '.'), and a log line."""

    type: str  # e.g. "agent_tool:recovery:row"
    run_id: str
    parent: ParentRef
    reason: str | None = None
    at: int
    details: dict[str, Any] = Field(default_factory=dict)
