"""The parent's queries: inspect, list and has_run, as faststream request handlers.

Each query is answered on its short subject `<prefix>.rpc.<kind>` and on the per-parent
form `<prefix>.rpc.<kind>.<agent>.<name>`, which NATS permissions can grant to the
application that owns the parent (`tether.access`); every parent replica shares the
`tether-parent` queue group. A request that is not a valid query gets a reply whose
`error` starts with "invalid request:"; a query that fails gets the error's type and text.
"""

import asyncpg
from faststream.middlewares import ExceptionMiddleware
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from pydantic import ValidationError

from tether.adapters.jetstream import EventLog
from tether.contract.messages import (
    HasRunReply,
    InspectReply,
    ListReply,
    RunSnapshot,
    UsageView,
)
from tether.contract.subjects import Subjects
from tether.domain.commands import HasRunQuery, InspectQuery, ListQuery
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState

QUERY_QUEUE = "tether-parent"
MAX_TREE_DEPTH = 16  # how deep a subtree's usage is summed
REPLIES = {"inspect": InspectReply, "list": ListReply, "has_run": HasRunReply}

LIST_RUNS = """
    SELECT state::text AS state FROM {schema}.runs
    WHERE parent_agent = $1 AND parent_name = $2
      AND ($3::text[] IS NULL OR status = ANY($3::text[]))
    ORDER BY requested_at DESC, run_id
    LIMIT $4
"""


def query_subjects(subjects: Subjects, kind: str) -> tuple[str, str]:
    """The short form, and the per-parent form that NATS permissions can scope."""
    return subjects.rpc(kind), subjects.rpc(kind) + ".*.*"


class ParentQueries:
    def __init__(self, log: EventLog | None, pool: asyncpg.Pool | None, projection_schema: str,
                 logger) -> None:
        self._log, self._pool, self._logger = log, pool, logger
        self._list_sql = LIST_RUNS.format(schema=f'"{projection_schema}"')

    def middleware(self) -> ExceptionMiddleware:
        """Turns a request that fails into the query's reply with an `error`."""
        return ExceptionMiddleware(publish_handlers={Exception: self._failed})

    def subscribe(self, broker: NatsBroker, subjects: Subjects) -> None:
        for kind, handler, summary in (
                ("inspect", self.inspect, "A run as the parent sees it, or null"),
                ("list", self.list_runs, "The parent's runs, newest first, by status"),
                ("has_run", self.has_run, "Whether the parent has the run")):
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
        subtree = snapshot.usage.plus(await self._descendants_usage(state, depth=0))
        return InspectReply(run=snapshot.model_copy(update={"subtree_usage": subtree}))

    async def _descendants_usage(self, state: RunState, depth: int) -> UsageView:
        """The model usage of every run below this one (runs it started, and theirs)."""
        assert self._log is not None
        total = UsageView()
        if depth >= MAX_TREE_DEPTH:
            return total
        owner = ParentRef(agent=state.agent_type, name=state.run_id)
        for run_id in await self._log.run_ids(owner):
            child = (await self._log.read_run(owner, run_id)).state
            if child is not None:
                total = total.plus(UsageView.of_steps(child.steps)).plus(
                    await self._descendants_usage(child, depth + 1))
        return total

    async def has_run(self, query: HasRunQuery, message: NatsMessage) -> HasRunReply:
        assert self._log is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        state = (await self._log.read_run(query.parent, query.run_id)).state
        return HasRunReply(has_run=state is not None)

    async def list_runs(self, query: ListQuery, message: NatsMessage) -> ListReply:
        assert self._pool is not None
        _check_subject_parent(message.raw_message.subject, query.parent)
        rows = await self._pool.fetch(self._list_sql, query.parent.agent, query.parent.name,
                                      query.status, query.limit)
        return ListReply(runs=[RunSnapshot.of(RunState.model_validate_json(r["state"]))
                               for r in rows])

    def _failed(self, error: Exception, message: NatsMessage):
        subject = message.raw_message.subject
        reply_model = REPLIES[subject.split(".")[2]]
        if isinstance(error, ValidationError | ValueError):
            return reply_model(error=f"invalid request: {error}")
        self._logger.error("rpc.failed", subject=subject, exc_info=error)
        return reply_model(error=f"{type(error).__name__}: {error}")


def _check_subject_parent(subject: str, parent: ParentRef) -> None:
    """A per-parent subject must name the query's parent: permissions are granted on the
    subject, so the payload may not reach past it."""
    tokens = subject.split(".")
    if len(tokens) == 5 and [parent.agent, parent.name] != tokens[3:]:
        raise ValueError(
            f"the payload's parent {parent.agent}/{parent.name} differs from the subject's "
            f"{tokens[3]}/{tokens[4]}")
