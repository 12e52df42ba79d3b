"""The parent's queries: inspect, list, has_run, history, serve_hook and chat_next, as
faststream request handlers.

Each query is answered on its short subject `<prefix>.rpc.<kind>` and on the per-parent
form `<prefix>.rpc.<kind>.<agent>.<name>`, which NATS permissions can grant to the
application that owns the parent (`tether.access`); every parent replica shares the
`tether-parent` queue group. A request that is not a valid query gets a reply whose
`error` starts with "invalid request:"; a query that fails gets the error's type and text.

`history`, `serve_hook` and `chat_next` are what an application in a NATS account of its
own needs instead of the JetStream API (`tether.access`): the stored messages of its
parent's feeds, its hook methods registered with their consumers made, and its durable
chat readers' messages (`adapters/chat_consumers.py`). `has_run` and
`history` read the streams for every request, so a requester from outside Tether's
account may ask them only so often (`tether.parent.rate_limit`); beyond that the reply's
`error` starts with "rate limited:" and `retry_after_ms` says when to ask again.
"""

import time

import asyncpg
from faststream.middlewares import ExceptionMiddleware
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from tether.adapters.chat_consumers import ServedChat
from tether.adapters.event_log import EventLog
from tether.adapters.hook_consumers import serve_hook
from tether.adapters.postgres.reads import ProjectionReads
from tether.config import Settings
from tether.contract.messages import (
    ChatNextReply,
    HasRunReply,
    HistoryReply,
    InspectReply,
    ListReply,
    RunSnapshot,
    ServeHookReply,
    StoredMessage,
    UsageView,
)
from tether.contract.subjects import Subjects
from tether.domain.chat import ChatKey
from tether.domain.commands import (
    ChatNextQuery,
    HasRunQuery,
    HistoryQuery,
    InspectQuery,
    ListQuery,
    ServeHookQuery,
)
from tether.domain.events import ParentRef
from tether.domain.history_parts import part_end, quoted_size
from tether.domain.run_state import RunState
from tether.parent.rate_limit import RequestRates, requester_of
from tether.run_tree import descendants

QUERY_QUEUE = "tether-parent"
REPLIES = {"inspect": InspectReply, "list": ListReply, "has_run": HasRunReply,
           "history": HistoryReply, "serve_hook": ServeHookReply, "chat_next": ChatNextReply}
# A history reply stays well under NATS's default max_payload (1 MiB).
HISTORY_REPLY_BYTES = 256 * 1024

def query_subjects(subjects: Subjects, kind: str) -> tuple[str, str]:
    """The short form, and the per-parent form that NATS permissions can scope."""
    return subjects.rpc(kind), subjects.rpc(kind) + ".*.*"


class ParentQueries:
    def __init__(self, log: EventLog | None, pool: asyncpg.Pool | None, projection_schema: str,
                 logger, *, rates: RequestRates | None = None,
                 settings: Settings | None = None) -> None:
        """`settings`: the chat readers' limits (`chat_next`); the defaults without."""
        self._log, self._pool, self._logger = log, pool, logger
        self._settings = settings or Settings()
        self._rates = rates
        self._chat: ServedChat | None = None
        self._projections = (ProjectionReads(pool, projection_schema)
                             if pool is not None else None)

    def middleware(self) -> ExceptionMiddleware:
        """Turns a request that fails into the query's reply with an `error`."""
        return ExceptionMiddleware(publish_handlers={Exception: self._failed})

    def subscribe(self, broker: NatsBroker, subjects: Subjects) -> None:
        for kind, handler, summary in (
                ("inspect", self.inspect, "A run as the parent sees it, or null"),
                ("list", self.list_runs,
                 "The parent's runs, newest first, by status and agent type, a page at a time"),
                ("has_run", self.has_run, "Whether the parent has the run"),
                ("history", self.history, "Stored messages of one of the parent's feeds"),
                ("serve_hook", self.serve_hook,
                 "Register a hook method and make its durable consumer"),
                ("chat_next", self.chat_next,
                 "A durable chat reader's next message, pulled by the parent")):
            for subject in query_subjects(subjects, kind):
                broker.subscriber(subject, queue=QUERY_QUEUE, title=f"{subject}:query",
                                  description=summary)(handler)

    async def inspect(self, query: InspectQuery, message: NatsMessage) -> InspectReply:
        assert self._log is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        # The run's subject contains its parent, so another parent's run id is simply
        # not there: "not found", never data.
        state = (await self._log.read_run(query.parent, query.run_id)).state
        if state is None:
            return InspectReply(run=None)
        snapshot = RunSnapshot.of(state)
        subtree = snapshot.usage.plus(await self._descendants_usage(state))
        return InspectReply(run=snapshot.model_copy(update={"subtree_usage": subtree}))

    async def _descendants_usage(self, state: RunState) -> UsageView:
        """The model usage of every run below this one (runs it started, and theirs)."""
        assert self._log is not None
        total = UsageView()
        for below in await descendants(self._log, state, open_only=False):
            total = total.plus(UsageView.of_steps(below.steps))
        return total

    def _too_often(self, kind: str, message: NatsMessage) -> tuple[str, int] | None:
        """The refusal and the milliseconds to wait, when the requester is over its rate."""
        if self._rates is None:
            return None
        requester = requester_of(message.raw_message.headers)
        if requester is None:
            return None
        wait_s = self._rates.take(requester, time.monotonic())
        if wait_s == 0:
            return None
        wait_ms = max(int(wait_s * 1000 + 0.999), 1)
        self._logger.warning("rpc.rate_limited", kind=kind, requester=requester,
                             retry_after_ms=wait_ms)
        return (f"rate limited: at most {self._rates.rate_per_s:g} has_run and history "
                f"queries a second ({self._rates.burst} at once) per NATS account outside "
                f"Tether's (TETHER_TENANT_QUERY_RATE_PER_S, TETHER_TENANT_QUERY_BURST); "
                f"ask again in {wait_ms} ms"), wait_ms

    async def has_run(self, query: HasRunQuery, message: NatsMessage) -> HasRunReply:
        assert self._log is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        if refusal := self._too_often("has_run", message):
            return HasRunReply(error=refusal[0], retry_after_ms=refusal[1])
        state = (await self._log.read_run(query.parent, query.run_id)).state
        ours = None
        if query.command_seq is not None:
            ours = await self._command_is(query.command_seq, query.parent, query.command_id,
                                          query.command_kind)
        return HasRunReply(has_run=state is not None, command_ours=ours)

    async def _command_is(self, seq: int, parent: ParentRef, message_id: str | None,
                          kind: str = "run") -> bool:
        """Whether the commands stream holds this parent's `kind` command with
        `message_id` at `seq` (not, say, another parent's command that carried the same
        id)."""
        assert self._log is not None
        subjects = self._log.subjects
        try:
            stored = await self._log.jetstream.get_msg(subjects.commands_stream, seq,
                                                       direct=True)
        except NotFoundError:
            return False
        headers = stored.headers or {}
        return (stored.subject == subjects.command_for(kind, parent)
                and headers.get("Nats-Msg-Id") == message_id)

    async def list_runs(self, query: ListQuery, message: NatsMessage) -> ListReply:
        assert self._projections is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        if query.count:
            runs, total = await self._projections.list_and_count_runs(
                query.parent, query.status, query.limit, agent_type=query.agent_type,
                before=query.before, waiting=query.waiting, canceled=query.canceled)
            return ListReply(runs=[RunSnapshot.of(state) for state in runs], total=total)
        runs = await self._projections.list_runs(query.parent, query.status, query.limit,
                                                 agent_type=query.agent_type,
                                                 before=query.before, waiting=query.waiting,
                                                 canceled=query.canceled)
        return ListReply(runs=[RunSnapshot.of(state) for state in runs])

    async def history(self, query: HistoryQuery, message: NatsMessage) -> HistoryReply:
        assert self._log is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        if refusal := self._too_often("history", message):
            return HistoryReply(error=refusal[0], retry_after_ms=refusal[1])
        subjects = self._log.subjects
        stream, per_parent, per_run = {
            "events": (subjects.events_stream, subjects.parent_events, subjects.run_events),
            "progress": (subjects.progress_stream, subjects.parent_progress,
                         subjects.run_progress),
            "chat": (subjects.chat_stream, subjects.chat, subjects.chat)}[query.feed]
        if query.run_id is None:
            filter_subject = per_parent(query.parent)
        else:  # a run's events or progress, or its conversation (`tether.domain.chat`)
            filter_subject = per_run(query.parent, query.run_id)
        if query.data_offset:
            return await self._rest_of_message(stream, filter_subject, query)
        if query.limit == 0:
            info = await self._log.jetstream.stream_info(stream)
            return HistoryReply(last_seq=info.state.last_seq)
        found, pending = await self._log.read_stored(stream, filter_subject,
                                                     start_seq=query.start_seq,
                                                     size=query.limit)
        budget = self._history_budget()
        messages: list[StoredMessage] = []
        size = 0
        for msg in found:
            stored = _stored_message(msg)
            size += quoted_size(stored.data) + len(stored.subject) + 64
            if size > budget:
                if not messages:  # too large for any reply whole: its first part
                    first = _stored_part(msg, 0, budget)
                    messages.append(first if first.is_partial else stored)
                break
            messages.append(stored)
        if messages:
            pending = messages[-1].pending
        return HistoryReply(messages=messages, pending=pending)

    def _history_budget(self) -> int:
        """The bytes a history reply's messages may take: under the server's max payload
        with room for the rest of the reply, whatever it is configured to."""
        assert self._log is not None
        return min(HISTORY_REPLY_BYTES, self._log.nats.max_payload // 2)

    async def _rest_of_message(self, stream: str, filter_subject: str,
                               query: HistoryQuery) -> HistoryReply:
        """The part of the message at `start_seq` from `data_offset` on."""
        assert self._log is not None
        found, _ = await self._log.read_stored(stream, filter_subject,
                                               start_seq=query.start_seq, size=1)
        if not found or _stored_message(found[0]).seq != query.start_seq:
            return HistoryReply(error=(
                f"the message at seq {query.start_seq} of {filter_subject} is no longer "
                "stored: read the feed again from there"))
        return HistoryReply(messages=[_stored_part(found[0], query.data_offset,
                                                   self._history_budget())])

    async def serve_hook(self, query: ServeHookQuery, message: NatsMessage) -> ServeHookReply:
        assert self._log is not None
        tokens = message.raw_message.subject.split(".")
        if len(tokens) == 5 and [query.parent_agent, query.method] != tokens[3:]:
            raise ValueError(f"the payload's hook {query.parent_agent}.{query.method} differs "
                             f"from the subject's {tokens[3]}.{tokens[4]}")
        consumer = await serve_hook(self._log.jetstream, self._log.subjects, query.parent_agent,
                                    query.method, lease_s=query.lease_ms / 1000,
                                    max_ack_pending=query.max_ack_pending)
        return ServeHookReply(consumer=consumer)

    async def chat_next(self, query: ChatNextQuery, message: NatsMessage) -> ChatNextReply:
        assert self._log is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        if self._chat is None:
            self._chat = ServedChat(self._log.nats, self._log.jetstream, self._log.subjects,
                                    self._settings)
        return ChatNextReply(messages=await self._chat.next(
            ChatKey(query.parent, query.run_id), query.durable, query.new_only, query.ack,
            drop=query.drop, renew=query.renew))

    def _failed(self, error: Exception, message: NatsMessage):
        subject = message.raw_message.subject
        reply_model = REPLIES[subject.split(".")[2]]
        if isinstance(error, ValidationError | ValueError):
            return reply_model(error=f"invalid request: {error}")
        self._logger.error("rpc.failed", subject=subject, exc_info=error)
        return reply_model(error=f"{type(error).__name__}: {error}")


def _stored_message(msg: Msg) -> StoredMessage:
    """A direct get's message as a history reply carries it whole."""
    headers = msg.headers or {}
    return StoredMessage(seq=int(headers["Nats-Sequence"]), subject=headers["Nats-Subject"],
                         data=msg.data.decode(errors="replace"),
                         pending=int(headers.get("Nats-Num-Pending", 0)))


def _stored_part(msg: Msg, offset: int, budget: int) -> StoredMessage:
    """The part of a message too large for a reply whole that starts at byte `offset`
    (`tether.domain.history_parts`); a `data_offset` past its end is an invalid
    request."""
    end = part_end(msg.data, offset, budget)
    return _stored_message(msg).model_copy(update={
        "data": msg.data[offset:end].decode(errors="replace"), "data_size": len(msg.data),
        "data_end": end})


def _check_subject_parent(subject: str, parent: ParentRef) -> None:
    """A per-parent subject must name the query's parent: permissions are granted on the
    subject, so the payload may not reach past it."""
    tokens = subject.split(".")
    if len(tokens) == 5 and [parent.agent, parent.name] != tokens[3:]:
        raise ValueError(
            f"the payload's parent {parent.agent}/{parent.name} differs from the subject's "
            f"{tokens[3]}/{tokens[4]}")
