"""A parent agent instance, as the application that owns it sees it."""

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from tether import tracing
from tether.client.arguments import (
    build_run_command,
    check_seconds,
    expires_in_ms,
    first_error,
    fork_request,
    ids_of,
)
from tether.client.awaiting import Answer
from tether.client.chat_feed import follow_chat
from tether.client.child_tool import AgentTool, agent_tool
from tether.client.errors import RequestFailed, RunNotFound
from tether.client.link import Link
from tether.client.placing import (
    RunRequest,
    Undecodable,
    Unserved,
    Untaken,
    WaitingReport,
)
from tether.client.sending import SEND_TIMEOUT_S, MessageReceipt, send_message
from tether.client.timeline import RunView, TimelineView, follow_timeline
from tether.contract.messages import (
    AgentToolFailure,
    AgentToolSuccess,
    ChatMessage,
    DetachedHandle,
    HasRunReply,
    InspectReply,
    ListReply,
    RunSnapshot,
)
from tether.domain.commands import (
    MAX_LIST_LIMIT,
    CancelCommand,
    ClearCommand,
    ContinueCommand,
    HasRunQuery,
    InspectQuery,
    ListCursor,
    ListQuery,
    RunCommand,
)
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef, RunRef
from tether.domain.ids import check_identifier, fork_run_id
from tether.domain.recorded import ForkPoint
from tether.domain.run_state import RunState
from tether.log import get_logger

CANCEL_PUBLISH_TIMEOUT_S = 5.0


def parent_handle(tether: Link, agent: str, name: str) -> "ParentHandle":
    """The parent agent instance (`agent` class, `name` instance) runs are made for."""
    ref = ParentRef(agent=check_identifier(agent, "parent agent"),
                    name=check_identifier(name, "parent name"))
    return ParentHandle(tether, ref)


class ParentHandle:
    def __init__(self, tether: Link, ref: ParentRef) -> None:
        self.tether = tether
        self.ref = ref

    @property
    def agent(self) -> str:
        return self.ref.agent

    @property
    def name(self) -> str:
        return self.ref.name

    def __repr__(self) -> str:
        return f"ParentHandle({self.ref.agent}/{self.ref.name})"

    # --- runs -------------------------------------------------------------------------

    async def run_agent_tool(
        self, agent_type: str, input: dict[str, Any] | BaseModel | None = None, *,
        run_id: str | None = None, parent_tool_call_id: str | None = None,
        display_order: int | None = None, display: str | None = None,
        detached: bool | dict[str, Any] | DetachedOptions = False,
        timeout: float | None = None, started_by: RunRef | None = None,
        expires_in: float | None = None, on_waiting: WaitingReport | None = None,
        cancel_with_caller: bool = True, max_tokens: int | None = None,
        max_cost: float | None = None, follow_up: str | None = None,
        turn: int | None = None,
    ) -> AgentToolSuccess | AgentToolFailure | DetachedHandle:
        """Run a child agent; idempotent by `run_id` (default: a new one).

        Awaited (the default): returns `AgentToolSuccess` or `AgentToolFailure` when the run
        ends; cancelling the awaiting task cancels the run. `timeout` (seconds) bounds the
        wait only: on expiry `TimeoutError` is raised and the run goes on.
        Detached: returns a `DetachedHandle` as soon as the parent accepted or rejected it.
        `started_by`: the run this parent is, when a child delegates (`RunContext` sets
        it): the notifications of a detached run go to that run's chat.
        `expires_in` (seconds): a request no parent service has taken by then is never
        applied (a parent that finds it later refuses it `expired`), and the call returns
        that failure. While no parent service answers, and while no child-runner of the
        agent type runs to start an accepted awaited run, `on_waiting` is told once, in
        words (default: a `run.unserved` warning in the client's log); it is told too of
        each message of the run this client cannot decode (a newer Tether's event), and
        when such a message stays the run's last for `AwaitTiming.unreadable_last_s` (10 s)
        the call raises `UnreadableOutcome`: it may be the run's outcome.
        `cancel_with_caller=False`: cancelling the awaiting task only stops the wait; the
        run goes on, still awaited, so a request under the same run id awaits it again
        (and the reconciler recovers it if none comes: docs/recovery.md).
        `max_tokens`, `max_cost`: a budget in model tokens and cost over the run and every
        run below it (default: its agent type's); a run that passes it ends
        `interrupted` (`budget-exceeded`) and the runs below it are cancelled.
        `follow_up`: the id of a finished run to ask again, with `input`: its next turn
        (the child keeps what it recorded; its agent type declares after which endings
        it takes one, `ChildAgent.follow_ups`), answered with that turn's outcome.
        Idempotent by (run id, `turn`): `turn` defaults to the run's next one (or, with
        `parent_tool_call_id`, the turn that tool call asked for already), so give it to
        make a retry after a crash ask for the same turn.
        """
        timeout = check_seconds(timeout, "timeout")
        if follow_up is not None:
            if run_id not in (None, follow_up):
                raise ValueError("follow_up names the run to ask again: give it or run_id, "
                                 "not both")
            run_id = follow_up
            if turn is None:
                turn = await self._next_turn(follow_up, parent_tool_call_id)
        elif turn is not None:
            raise ValueError("turn is the turn of a follow-up: give follow_up=<run id> too")
        command = build_run_command(self.ref, agent_type, input, run_id=run_id,
                                    parent_tool_call_id=parent_tool_call_id,
                                    display_order=display_order, display=display,
                                    detached=detached, started_by=started_by,
                                    expires_in=expires_in, max_tokens=max_tokens,
                                    max_cost=max_cost, turn=turn)
        report = on_waiting or log_unserved
        if not tracing.ENABLED:
            return await self._run(command, command.detached is not False, timeout, report,
                                   cancel_with_caller)
        with tracing.span(f"invoke_agent {command.agent_type}", tracing.CLIENT,
                          attributes=tracing.invoke_agent_attributes(
                              command.agent_type, command.run_id, self.ref)) as span:
            answer = await self._run(command, command.detached is not False, timeout, report,
                                     cancel_with_caller)
            span.set_attribute("tether.run.status", _status_of(answer))
            return answer

    async def _run(self, command: RunCommand, detached: bool, timeout: float | None,
                   report: WaitingReport, cancel_with_caller: bool = True) -> Answer:
        """Publish the request and fold the run's events until they answer it.

        The live subscription comes first: the server handles one connection's messages in
        order, so every event stored after the request was published reaches it (or, when
        core delivery loses one, the next one's previous sequence reveals the gap). Most
        run ids are new, so the request goes out before the run is read: what arrives
        first says where the run stood before the request (`RunRequest`), and only a run that
        already has events is read.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        live: asyncio.Queue[Msg] = asyncio.Queue()
        subscription = await self.tether.subscribe_live(
            self.tether.subjects.run_live(self.ref, command.run_id), live.put_nowait)
        # Present as the run's awaiter while waiting: the reconciler recovers an awaited
        # run only once nobody answers here (docs/recovery.md).
        awaiter = None if detached else await self.tether.subscribe_live(
            self.tether.subjects.awaiter(self.ref, command.run_id), self.tether.answer_present)
        try:
            request = RunRequest(self.tether, self.ref, command, detached)
            answer = await request.publish()
            unserved = Unserved(self.tether, self.ref, command, detached, report,
                                published_at=loop.time())
            untaken = Untaken(self.tether, command, report)
            undecodable = Undecodable(self.tether, command.run_id, request.subject, report)
            timing = self.tether.awaiting
            idle = timing.live_idle_s
            while answer is None:
                undecodable.look(request.run, loop.time())
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                wait = idle if remaining is None else min(remaining, idle)
                if not request.taken:
                    wait = min(wait, unserved.next_look_in(loop.time(), timing.live_idle_max_s))
                else:
                    wait = min(wait, untaken.next_look_in(request.state, loop.time(), wait))
                wait = undecodable.next_look_in(loop.time(), wait)
                try:
                    # Only the wait is bounded: a timeout must not look like a cancellation.
                    # (asyncio.timeout, not wait_for: Python 3.11's wait_for returns a
                    # result that lands with a cancellation and drops the cancellation.)
                    async with asyncio.timeout(wait):
                        message = await live.get()
                except TimeoutError:
                    if remaining is not None and remaining <= wait:
                        raise TimeoutError(
                            f"run {command.run_id} gave no answer within {timeout:g}s; it goes "
                            "on: inspect it, or await it again with the same run_id") from None
                    answer = await request.on_quiet()
                    if answer is None and not request.taken:
                        answer = await unserved.look(loop.time())
                    elif answer is None:
                        await untaken.look(request.state, loop.time())
                    idle = min(idle * 2, timing.live_idle_max_s)
                    continue
                idle = timing.live_idle_s
                answer = await request.on_message(message)
            return answer
        except asyncio.CancelledError:
            if not detached and cancel_with_caller:
                # The caller gave up on an awaited run (whose request may have reached the
                # stream by now): the run must not outlive it.
                await asyncio.shield(self._cancel_quietly(command.run_id))
            raise
        finally:
            for held in (subscription, awaiter):
                if held is not None:
                    with suppress(Exception):  # the connection may already be closing
                        await held.unsubscribe()

    async def _cancel_quietly(self, run_id: str) -> None:
        # Best effort: the caller is leaving, and a cancel that cannot be sent must not
        # replace the CancelledError it is handling.
        with suppress(Exception):
            async with asyncio.timeout(CANCEL_PUBLISH_TIMEOUT_S):
                await self.cancel(run_id)

    async def fork(self, run_id: str, *, at: str | int, input: dict[str, Any] | BaseModel | None = None,
                   agent_overrides: dict[str, Any] | None = None, fork_id: str | None = None,
                   detached: bool | dict[str, Any] | DetachedOptions = False,
                   timeout: float | None = None, on_waiting: WaitingReport | None = None,
                   expires_in: float | None = None,
                   ) -> AgentToolSuccess | AgentToolFailure | DetachedHandle:
        """Run `run_id` (one of this parent's runs) again from a point, beside it: a new run
        that reuses what it had recorded by then (no recorded model call or tool call is
        made again) and goes on with this code, `input` (default: the run's) and
        `agent_overrides` (a model agent's `instructions`, `model`, `max_steps`). `at`:
        `step:<n>` (steps before n reused; an int is a step), `milestone:<name>` or
        `seq:<n>` (a stream sequence, as the UI's slider shows it). Awaited or detached as
        `run_agent_tool`, `expires_in` too; idempotent: the same fork asked again (its
        `fork_id`, by default made from the run, `at`, `input` and `agent_overrides`) is
        that fork."""
        timeout = check_seconds(timeout, "timeout")
        check_identifier(run_id, "run id")
        if isinstance(at, bool) or not isinstance(at, str | int):
            raise TypeError(f"at is a fork point (step:<n>, milestone:<name> or seq:<n>, or an "
                            f"int: a step), not {type(at).__name__}")
        point = f"step:{at}" if isinstance(at, int) else str(ForkPoint.parse(at))
        fork = fork_request(run_id, point, agent_overrides)
        source = await self._read_own(run_id, "fork")
        if isinstance(input, BaseModel):
            input = input.model_dump(mode="json")
        given = source.input if input is None else input
        fork_id = fork_id or fork_run_id(run_id, point, input, agent_overrides or {})
        command = build_run_command(
            self.ref, source.agent_type, given, run_id=fork_id,
            parent_tool_call_id=source.parent_tool_call_id, display_order=source.display_order,
            display=source.display, detached=detached, started_by=source.started_by,
            max_tokens=source.max_tokens, max_cost=source.max_cost, fork=fork,
            expires_in=expires_in)
        return await self._run(command, command.detached is not False, timeout,
                               on_waiting or log_unserved)

    async def rewind(self, run_id: str, *, timeout: float | None = None,
                     detached: bool | dict[str, Any] | DetachedOptions = False,
                     on_waiting: WaitingReport | None = None, expires_in: float | None = None,
                     ) -> AgentToolSuccess | AgentToolFailure | DetachedHandle:
        """Take the failed run `run_id` up again from its last recorded step, as a new
        attempt of the same run (its steps are not made again; the tool that failed, fixed
        since, runs again), and await its new outcome (or, `detached`, return once the
        parent took it). A detached run's hooks and notices are sent again for the new
        outcome. A run that is not failed is refused, saying why; asked again while the
        rewind runs, it awaits that rewind. `expires_in` and `on_waiting` as
        `run_agent_tool`'s: while no parent service answers, it is told so, and an expired
        rewind is answered as such."""
        timeout = check_seconds(timeout, "timeout")
        state = await self._read_own(run_id, "rewind")
        number = state.rewinds + 1 if state.status == "error" or state.rewinds == 0 \
            else state.rewinds
        command = build_run_command(
            self.ref, state.agent_type, state.input, run_id=run_id,
            parent_tool_call_id=state.parent_tool_call_id, display_order=state.display_order,
            display=state.display, detached=detached, started_by=state.started_by,
            rewind=number, expires_in=expires_in)
        return await self._run(command, command.detached is not False, timeout,
                               on_waiting or log_unserved)

    async def _read_own(self, run_id: str, what: str) -> RunState:
        state = (await self.tether.read_run(self.ref, check_identifier(run_id, "run id"))).state
        if state is None:
            raise RunNotFound(f"no run {run_id!r} of {self.ref.agent}/{self.ref.name} to "
                              f"{what}: a parent {what}s its own runs only")
        return state

    async def _next_turn(self, run_id: str, parent_tool_call_id: str | None) -> int:
        """The turn a follow-up of `run_id` asks for: the one a tool call of that id asked
        for already, else the run's next."""
        state = (await self.tether.read_run(self.ref, check_identifier(run_id, "run id"))).state
        if state is None:
            return 2  # (refused by the parent: no run to follow up)
        if parent_tool_call_id is not None:
            if state.turn > 1 and state.parent_tool_call_id == parent_tool_call_id:
                return state.turn
            for done in state.turns[1:]:
                if done.parent_tool_call_id == parent_tool_call_id:
                    return done.turn
        return state.turn + 1

    async def cancel(self, run_id: str, *, expires_in: float | None = None) -> None:
        """Ask the parent to cancel the run; idempotent, and a finished run stays as it is.
        `expires_in` (seconds): not applied by a parent that takes it later than that."""
        check_identifier(run_id, "run id")
        command = CancelCommand(run_id=run_id, parent=self.ref,
                                expires_in_ms=expires_in_ms(expires_in))
        await self.tether.publish_command("cancel", command,
                                          f"cancel:{run_id}:{uuid.uuid4().hex}")

    async def continue_run(self, run_id: str, *, approvals: Iterable[str] = (),
                           rejections: Iterable[str] = (),
                           tool_outputs: dict[str, Any] | None = None,
                           human_input: str | None = None, below: Iterable[str] = (),
                           expires_in: float | None = None) -> None:
        """Answer a paused run of this parent (`tether.cmd.continue`): it resumes in
        whichever runner picks it up. A run that is not paused ignores the answers.
        `below`: the run ids down the run's tree to the paused one (a `waiting_path`);
        `expires_in` (seconds): not applied by a parent that takes it later than that."""
        check_identifier(run_id, "run id")
        try:
            command = ContinueCommand(
                run_id=run_id, parent=self.ref, below=ids_of(below, "below"),
                approvals=ids_of(approvals, "approvals"),
                rejections=ids_of(rejections, "rejections"),
                tool_outputs={} if tool_outputs is None else tool_outputs,
                human_input=human_input, expires_in_ms=expires_in_ms(expires_in))
        except ValidationError as error:
            raise ValueError(f"invalid continue request: {first_error(error)}") from None
        await self.tether.publish_command("continue", command,
                                          f"continue:{run_id}:{uuid.uuid4().hex}")

    async def send(self, run_id: str, text: str | None = None, *, data: Any = None,
                   mode: Literal["queue", "interrupt"] = "queue",
                   message_id: str | None = None, below: Iterable[str] = (),
                   expires_in: float | None = None,
                   timeout: float = SEND_TIMEOUT_S,
                   on_waiting: WaitingReport | None = None) -> MessageReceipt:
        """Send a message to a running run of this parent (steering): `text`, `data` or
        both. The parent records it in the run's log, once per `message_id` (default: a
        new one; send again with the same id and it is recorded once), and the child
        gets it at its next step boundary (a model child: before its next model call, as
        a user message; any child: `ctx.messages()`, `ctx.next_message()`). `interrupt`
        stops the child's current model or tool call first. Returns once the message is
        in the run's log; its receipts (delivered, consumed) follow there (`inspect`,
        the timeline). `MessageRefused` when the run takes no message (it ended, is being
        cancelled, is not there); `TimeoutError` when no parent service took it within
        `timeout` seconds (it waits in the commands stream and is applied when one
        does, unless `expires_in` seconds ran out first). While no parent service answers
        (none runs, or it is stopped), `on_waiting` is told once, two seconds after the
        send, as `run_agent_tool`'s is; a message still not recorded `expires_in` seconds
        (plus two) after it was sent raises `MessageRefused` (`expired`) then, since no
        parent will record it. `below`: the run ids down the run's tree to the one the
        message is for (a timeline's `waiting_path`)."""
        return await send_message(self.tether, self.ref, run_id, text, data=data, mode=mode,
                                  message_id=message_id, below=below, expires_in=expires_in,
                                  timeout=timeout, on_waiting=on_waiting or log_unserved)

    async def continue_waiting(self, view: "RunView", **answers: Any) -> None:
        """Answer the run a timeline shows waiting: the run itself when it is paused, or
        the descendant at the end of its `waiting_path` (only that one resumes), found
        by the parent down this run's tree, so the grants for this parent suffice."""
        await self.continue_run(view.run_id, below=[hop["run_id"] for hop in view.waiting_path],
                                **answers)

    async def clear(self, status: Iterable[str] | str | None = None,
                    older_than: int | datetime | None = None, *,
                    expires_in: float | None = None) -> None:
        """Ask the parent to clear retained runs (open ones are cancelled first).

        `status`: only runs in these statuses; `older_than`: only runs requested before this
        moment (epoch milliseconds or a datetime). Only runs requested before the clear
        are touched, however late a parent handles it; `expires_in` (seconds): not applied
        at all by a parent that takes it later than that.
        """
        if isinstance(status, str):
            status = [status]
        if isinstance(older_than, datetime):
            older_than = int(older_than.timestamp() * 1000)
        try:
            command = ClearCommand(parent=self.ref,
                                   status=list(status) if status is not None else None,
                                   older_than=older_than, expires_in_ms=expires_in_ms(expires_in))
        except ValidationError as error:
            raise ValueError(f"invalid clear request: {first_error(error)}") from None
        await self.tether.publish_command(
            "clear", command, f"clear:{self.ref.agent}:{self.ref.name}:{uuid.uuid4().hex}")

    # --- queries ----------------------------------------------------------------------

    async def inspect(self, run_id: str, *, timeout: float | None = None) -> RunSnapshot | None:
        """The run as the parent knows it; None when this parent has no such run."""
        timeout = check_seconds(timeout, "timeout")
        query = InspectQuery(run_id=check_identifier(run_id, "run id"), parent=self.ref)
        reply = await self.tether.request("inspect", query, InspectReply, timeout=timeout)
        return reply.run

    async def list_runs(self, status: Iterable[str] | str | None = None, limit: int = 100, *,
                        agent_type: str | None = None,
                        before: ListCursor | RunSnapshot | None = None,
                        waiting: bool | None = None, canceled: bool | None = None,
                        timeout: float | None = None) -> list[RunSnapshot]:
        """The parent's runs, newest first: `limit` of them, of these statuses and of
        `agent_type` (None: any), after `before` (a run listed earlier, or its cursor;
        None: from the newest). `waiting`: only runs paused for a human or for tool
        output (True) or only the others (False); `canceled`: only runs aborted on a
        cancel request (True) or only the others (False); None: either. A parent service
        from before `waiting` and `canceled` refuses a query that gives one. `list_page`
        also counts them and says where the next page starts."""
        query = self._list_query(status, limit, agent_type, before, waiting, canceled)
        timeout = check_seconds(timeout, "timeout")
        return (await self.tether.request("list", query, ListReply, timeout=timeout)).runs

    async def list_page(self, status: Iterable[str] | str | None = None, limit: int = 100, *,
                        agent_type: str | None = None,
                        before: ListCursor | RunSnapshot | None = None,
                        waiting: bool | None = None, canceled: bool | None = None,
                        timeout: float | None = None) -> "RunsPage":
        """A page of `list_runs` with the number of runs the filters select (`total`,
        whatever the page) and the cursor of the next page (`after`: None when no run
        follows). Asks a parent service that pages its list (`before`, `total`): an
        older one refuses the query."""
        query = self._list_query(status, limit, agent_type, before, waiting, canceled)
        if limit >= MAX_LIST_LIMIT:
            raise ValueError(f"invalid list request: limit: a page is at most "
                             f"{MAX_LIST_LIMIT - 1} runs, not {limit}")
        timeout = check_seconds(timeout, "timeout")
        # One run more than the page, to know whether another page follows.
        query = query.model_copy(update={"limit": limit + 1, "count": True})
        reply = await self.tether.request("list", query, ListReply, timeout=timeout)
        if reply.total is None:
            raise RequestFailed(f"the parent service answered {self.ref.agent}/"
                                f"{self.ref.name}'s list query without its total")
        runs = reply.runs[:limit]
        after = cursor_of(runs[-1]) if len(reply.runs) > limit else None
        return RunsPage(runs=runs, total=reply.total, after=after)

    def _list_query(self, status: Iterable[str] | str | None, limit: int,
                    agent_type: str | None, before: ListCursor | RunSnapshot | None,
                    waiting: bool | None, canceled: bool | None) -> ListQuery:
        if isinstance(status, str):
            status = [status]
        if agent_type is not None:
            check_identifier(agent_type, "agent type")
        if isinstance(before, RunSnapshot):
            before = cursor_of(before)
        elif before is not None and not isinstance(before, ListCursor):
            raise TypeError(f"before is a ListCursor or a RunSnapshot listed earlier, not "
                            f"{type(before).__name__}")
        try:
            return ListQuery(parent=self.ref, limit=limit,
                             status=list(status) if status is not None else None,
                             agent_type=agent_type, before=before, waiting=waiting,
                             canceled=canceled)
        except ValidationError as error:
            raise ValueError(f"invalid list request: {first_error(error)}") from None

    async def has_run(self, run_id: str, *, timeout: float | None = None) -> bool:
        timeout = check_seconds(timeout, "timeout")
        query = HasRunQuery(run_id=check_identifier(run_id, "run id"), parent=self.ref)
        return (await self.tether.request("has_run", query, HasRunReply, timeout=timeout)).has_run

    # --- subscriptions and tools ------------------------------------------------------

    def timeline(self, *, run_id: str | None = None,
                 live: bool = True) -> AsyncGenerator["TimelineView", None]:
        """The parent's runs (or one run), replayed from the start and then live.

        Yields a `TimelineView` once caught up with the log (even an empty one) and after
        every change; with `live=False` it ends once caught up.
        """
        return follow_timeline(self.tether, self.ref, run_id=run_id, live=live)

    def chat(self, *, durable: str | None = None,
             new_only: bool = False) -> AsyncIterator["ChatMessage"]:
        return follow_chat(self.tether, self.ref, durable=durable, new_only=new_only)

    def agent_tool(self, agent_type: Any, *, description: str | None = None,
                   display_name: str | None = None, input_model: type[BaseModel] | None = None,
                   name: str | None = None) -> "AgentTool":
        """An `AgentTool` bound to this parent (see `tether.client.child_tool.agent_tool`)."""
        return agent_tool(agent_type, description=description, display_name=display_name,
                          input_model=input_model, name=name).bind(self)


@dataclass(frozen=True)
class RunsPage:
    """A page of the parent's runs (`ParentHandle.list_page`): `total` runs of its
    statuses and agent type in all; `after`: the next page's cursor (`before=`), None on
    the last page."""

    runs: list[RunSnapshot]
    total: int
    after: ListCursor | None


def cursor_of(run: RunSnapshot) -> ListCursor:
    """Where the list goes on after `run` (`before=`)."""
    return ListCursor(requested_at=run.requested_at, run_id=run.run_id)


def log_unserved(text: str) -> None:
    get_logger(component="client").warning("run.unserved", waiting_for=text)


def _status_of(answer: Answer) -> str:
    """A run's answer in one word for its span: `completed`, the failure's status, or a
    detached run's (`running`, `error`)."""
    status = getattr(answer, "status", None)
    return status if isinstance(status, str) else "completed"
