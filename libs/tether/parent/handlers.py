"""The parent's command handlers: run, cancel, clear.

Each handler parses, loads the run from the log, decides with the pure functions of
`tether.domain.decide`, and appends with optimistic concurrency (`EventLog.update`), so
concurrent requests for one run id on any number of parent replicas converge on one
child turn. Answers go back as events on the run's subject; a command that cannot be
parsed at all is kept as a dead letter.
"""

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
from pydantic import ValidationError

from tether.agent_registry import AgentRegistry
from tether.contract.messages import (
    RUN_SEQUENCE_HEADER,
    CancelSignal,
    ChatMessage,
    MessageSignal,
    WorkItem,
    work_item_json,
)
from tether.domain import decide, spending
from tether.domain.chat import ChatKey, chat_of, chat_of_new_run, started_by_error
from tether.domain.commands import (
    CancelCommand,
    ClearCommand,
    ContinueCommand,
    DeliveredCommand,
    MessageCommand,
    RunCommand,
    SendCommand,
    parse_command,
)
from tether.domain.decide import delivery_entry_of_report, record_delivery_of_this_life
from tether.domain.events import Event, ParentRef, RunRef, RunRequested
from tether.domain.fold import fold
from tether.domain.ids import check_identifier, names_this_life, user_message_id, work_message_id
from tether.domain.run_state import RunState
from tether.domain.spending import BUDGET_EXCEEDED
from tether.domain.usage import Amount, key_of
from tether.parent.slots import SlotKeeper
from tether.ports import SYSTEM_CLOCK, Clock, EventLog
from tether.run_tree import TreeCancel, cancel_tree, cancels_below, descendants

if TYPE_CHECKING:
    from tether.delivery.deliverer import Deliverer

# A command's JSON object, or its bytes when the service could not make one of them (the
# handler then says why).
Payload = dict[str, Any] | bytes


class UnparseableCommand(Exception):
    """A command with no valid run id and parent to answer on: it is dead-lettered."""


@dataclass(frozen=True)
class RunOutcome:
    """What a run request came to, for logs and tests."""

    decision: str  # created | rejected | existing | reattached | redispatched
    status: str | None = None
    code: str | None = None


class CommandHandlers:
    def __init__(self, log: EventLog, agents: AgentRegistry, *, budgets: decide.Budgets,
                 slots: SlotKeeper | None, default_cap: int | None, max_input_bytes: int,
                 hook_registered, deliverer: "Deliverer | None" = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """`deliverer`: delivers the hooks of the outcomes these handlers append (a
        cancel's); None where nothing is to be delivered (tests of the decisions).
        `clock`: the time of the causes of what they decide."""
        self._log = log
        self._subjects = log.subjects
        self._agents = agents
        self._budgets = budgets
        self._slots = slots
        self._default_cap = default_cap
        self._max_input_bytes = max_input_bytes
        self._hook_registered = hook_registered
        self._deliverer = deliverer
        self._clock = clock

    def cap_for(self, parent: ParentRef) -> int | None:
        """The parent's cap: its own class attribute when it is a child agent, else the service's."""
        agent = self._agents.get(parent.agent)
        if agent is not None and agent.max_concurrent_agent_tools is not None:
            return agent.max_concurrent_agent_tools
        return self._default_cap

    # --- run ------------------------------------------------------------------------

    async def run(self, payload: Payload, seq: int, *, overdue: int | None = None) -> RunOutcome:
        """`overdue`: by how many ms the request is past its expiry (None: it is not)."""
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        raw = _json_object(payload)
        try:
            command = parse_command("run", raw)
        except (ValidationError, ValueError) as error:
            run_id, parent = _answerable(raw)
            await self._reject(run_id, parent, raw.get("agent_type"), "invalid-request",
                               _explain(error), cause)
            return RunOutcome("rejected", code="invalid-request")
        if command.turn is not None:
            return await self._follow_up(command, cause, overdue)
        if overdue is not None:
            return await self._expired(command, overdue, cause)

        problem = await self._validate(command)
        spend = await self._spend(command) if problem is None else decide.NO_SPEND
        cap = self.cap_for(command.parent)
        takes_slot = cap is not None and self._slots is not None
        if problem is None and not takes_slot and not spend.above:
            # Most run ids are new: the request is appended expecting the run's subject
            # empty, without reading it first; when it is not, the run is read and
            # answered as below.
            requested = decide.request_run(command, self._budgets, cause, spend)
            if (created := await self._log.append_new(requested)) is not None:
                state, requested_seq = created
                await self._dispatch(state, requested, requested_seq)
                return RunOutcome("created", status="starting")

        history = await self._log.read_run(command.parent, command.run_id)
        if history.state is not None:
            return await self._existing(history.state, history.last_seq, cause)
        if problem is not None:
            code, reason = problem
            await self._reject(command.run_id, command.parent, command.agent_type, code, reason,
                               cause)
            return RunOutcome("rejected", code=code)
        if takes_slot:
            assert cap is not None and self._slots is not None
            slot = await self._slots.acquire(command.parent, command.run_id, cap, cause.now)
            if not slot.admitted:
                await self._reject(command.run_id, command.parent, command.agent_type,
                                   "concurrency-cap", f"maxConcurrentAgentTools ({cap}) exceeded",
                                   cause)
                return RunOutcome("rejected", code="concurrency-cap")
        if spend.above and (why := await self._reserve(command, spend, cause)) is not None:
            if takes_slot:
                assert self._slots is not None
                await self._slots.release(command.parent, command.run_id)
            await self._reject(command.run_id, command.parent, command.agent_type,
                               BUDGET_EXCEEDED, why, cause)
            return RunOutcome("rejected", code=BUDGET_EXCEEDED)
        return await self._create(command, cause, spend)

    async def _spend(self, command: RunCommand) -> decide.Spend:
        """The run's budget in tokens and cost (the request's, else its agent type's), and
        the budgeted runs above it: the run that started it, if it has a budget, and the
        ones above that."""
        agent = self._agents.get(command.agent_type)
        max_tokens = command.max_tokens or (agent.max_tokens if agent else None)
        max_cost = command.max_cost or (agent.max_cost if agent else None)
        above: tuple[RunRef, ...] = ()
        if command.started_by is not None:
            starter = command.started_by
            state = (await self._log.read_run(starter.parent, starter.run_id)).state
            if state is not None:
                above = ((starter,) if spending.has_budget(state) else ()) + state.budgets_above
        return decide.Spend(max_tokens=max_tokens, max_cost=max_cost, above=above)

    async def _reserve(self, command: RunCommand, spend: decide.Spend,
                       cause: decide.Cause) -> str | None:
        """Reserve the run's share of every budget above it (its own budget, else its
        agent type's estimate), nearest first; None when all had room, else why one had
        none (what was reserved on the others is freed again)."""
        agent = self._agents.get(command.agent_type)
        share = Amount(
            tokens=spend.max_tokens or (agent.estimated_tokens if agent else 0),
            cost=spend.max_cost or (agent.estimated_cost if agent else 0.0))
        run = RunRef(parent=command.parent, run_id=command.run_id)
        taken: list[RunRef] = []
        for owner in spend.above:
            state, appended = await self._log.recent.update(
                owner.parent, owner.run_id, lambda s: spending.reserve(s, run, share, cause))
            if appended or (state is not None and key_of(run) in state.spending):
                taken.append(owner)
                continue
            for done in taken:
                await self._log.recent.update(done.parent, done.run_id,
                                              lambda s: spending.release(s, run, cause))
            if state is None:
                return f"the budgeted run {owner.run_id} above it is gone"
            return spending.room_for(state, share) or f"run {owner.run_id} had no room"
        return None

    async def _follow_up(self, command: RunCommand, cause: decide.Cause,
                         overdue: int | None) -> RunOutcome:
        """Turn `command.turn` of a finished run: appended and dispatched when it is the
        next one and the child takes it; the turn's caller is told of one already there
        (the same follow-up again); refused, saying why, otherwise."""
        assert command.turn is not None
        problem = await self._validate(command)
        if problem is None and overdue is not None:
            waited_s = ((command.expires_in_ms or 0) + overdue) / 1000
            problem = ("expired", (f"the follow-up waited {waited_s:.1f}s for a parent "
                                   f"service, longer than its expires_in_ms "
                                   f"({command.expires_in_ms}): not applied"))
        agent = self._agents.get(command.agent_type)
        accepts = frozenset(agent.follow_ups) if agent is not None else frozenset()
        state, appended, last_seq = await self._log.recent.update_at(
            command.parent, command.run_id,
            lambda s: [] if problem is not None else decide.request_turn(
                s, command, self._budgets, accepts, cause))
        if appended and state is not None:
            await self._publish_work(state, dispatch=1, why=f"turn{command.turn}")
            return RunOutcome("created", status="starting")
        why = problem[1] if problem is not None else decide.why_no_turn(state, command, accepts)
        if why is None and state is not None:  # the same follow-up again
            if state.turn == command.turn and state.status == "starting":
                await self._publish_work(state, dispatch=1, why=f"turn{command.turn}")
            await self._tell_existing(state, last_seq)
            return RunOutcome("existing", status=state.status)
        code = problem[0] if problem is not None else "no-follow-up"
        await self._reject(command.run_id, command.parent, command.agent_type, code,
                           why or "not applied", cause)
        return RunOutcome("rejected", code=code)

    async def _expired(self, command: RunCommand, overdue: int, cause: decide.Cause
                       ) -> RunOutcome:
        """A request past its expiry acts on nothing: a run it names that exists is only
        told to its requester (not re-dispatched, not re-attached), and one that does not
        is refused `expired`, which leaves the run id free."""
        history = await self._log.read_run(command.parent, command.run_id)
        if history.state is not None:
            await self._tell_existing(history.state, history.last_seq)
            return RunOutcome("expired", status=history.state.status)
        assert command.expires_in_ms is not None
        waited_s = (command.expires_in_ms + overdue) / 1000
        await self._reject(command.run_id, command.parent, command.agent_type, "expired",
                           f"the request waited {waited_s:.1f}s for a parent service, longer "
                           f"than its expires_in_ms ({command.expires_in_ms}): not applied",
                           cause)
        return RunOutcome("rejected", code="expired")

    async def _create(self, command: RunCommand, cause: decide.Cause,
                      spend: decide.Spend = decide.NO_SPEND) -> RunOutcome:
        requested = decide.request_run(command, self._budgets, cause, spend)
        state, appended, requested_seq = await self._log.recent.update_at(
            command.parent, command.run_id, lambda s: [requested] if s is None else [])
        assert state is not None  # ours, or another replica's created between read and append
        if not appended:
            return await self._existing(state, requested_seq, cause)
        await self._dispatch(state, requested, requested_seq)
        return RunOutcome("created", status="starting")

    async def _existing(self, state: RunState, seq: int, cause: decide.Cause) -> RunOutcome:
        """A repeated run id never starts a second child turn. The requester is told the
        run exists (`_tell_existing`), since what this appends may be nothing."""
        outcome = await self._answer_existing(state, cause)
        await self._tell_existing(state, seq)
        return outcome

    async def _tell_existing(self, state: RunState, seq: int) -> None:
        """An empty message on the run's live subject, `Tether-Run-Sequence: <seq>`: the
        run's last stream sequence when this request found it. A client that published
        the request without reading the run first reads it now, and takes `seq` as the
        run's end before its request (client/awaiting.py). Core NATS, at most once: a
        client that misses it reads the run after a second without an answer."""
        await self._log.notify(self._subjects.run_live(state.parent, state.run_id), b"",
                               headers={RUN_SEQUENCE_HEADER: str(seq)})

    async def _answer_existing(self, state: RunState, cause: decide.Cause) -> RunOutcome:
        if state.status == "starting":
            # Its work item may never have gone out (the parent that appended the request
            # died first), so it goes out again: within the work stream's duplicate window
            # the stream drops it, and after it the runner skips an item whose run another
            # item already started (`WorkItem.attempt`).
            await self._dispatch(state)
            return RunOutcome("redispatched", status=state.status)
        if state.status == "interrupted":
            after, appended = await self._log.recent.update(
                state.parent, state.run_id, lambda s: decide.reattach(s, cause))
            if not appended:  # given up for good (`RunState.resumable`), or repaired
                return RunOutcome("existing", status=state.status)
            if after is not None and not after.child_still_running:
                # Nobody is running the child: hand it to a runner, which resumes the
                # same turn after what was recorded.
                await self._publish_work(after, dispatch=after.reattach_attempts, why="reattach")
            return RunOutcome("reattached", status="interrupted")
        return RunOutcome("existing", status=state.status)

    async def _validate(self, command: RunCommand) -> tuple[str, str] | None:
        size = len(json.dumps(command.input, separators=(",", ":")).encode())
        if size > self._max_input_bytes:
            return ("input-too-large",
                    f"input is {size} bytes; the limit is {self._max_input_bytes} bytes")
        agent = self._agents.get(command.agent_type)
        if agent is None:
            known = ", ".join(self._agents.agent_types) or "none"
            return ("unknown-agent-type",
                    f"unknown agent type {command.agent_type!r}; this parent knows: {known}")
        try:
            agent.input_model.model_validate(command.input)
        except ValidationError as error:
            return ("invalid-input", f"input for {command.agent_type}: {_explain(error)}")
        if (wrong := started_by_error(command.parent, command.started_by)) is not None:
            return ("invalid-started-by", wrong)
        options = command.detached_options()
        on_finish = options.on_finish if options is not None else None
        if on_finish and not await self._hook_registered(command.parent.agent, on_finish):
            missing = (f"no hook handler has registered {on_finish!r} for parent agent "
                       f"{command.parent.agent!r}; register it before starting detached runs")
            return ("unknown-hook", missing)
        return None

    async def _dispatch(self, state: RunState, requested: RunRequested | None = None,
                        requested_seq: int | None = None) -> None:
        """Put a starting run on the runners' queue. No event records it: the command is
        acknowledged only after this, so a parent that dies first gets the command again
        and dispatches then. `requested` (with its stream sequence) lets the runner start
        a new run without reading it."""
        await self._publish_work(state, dispatch=1, requested=requested,
                                 requested_seq=requested_seq)

    async def _publish_work(self, state: RunState, dispatch: int, why: str = "start", *,
                            requested: RunRequested | None = None,
                            requested_seq: int | None = None) -> None:
        item = WorkItem(run_id=state.run_id, parent=state.parent, agent_type=state.agent_type,
                        dispatch=dispatch, attempt=state.attempt, requested=requested,
                        requested_seq=requested_seq)
        message_id = work_message_id(state.run_id, dispatch, why, state.incarnation)
        await self._log.publish(self._subjects.work(state.agent_type), work_item_json(item),
                                headers={"Nats-Msg-Id": message_id},
                                stream=self._subjects.work_stream)

    async def _reject(self, run_id: str | None, parent: ParentRef | None, agent_type: Any,
                      code: str, error: str, cause: decide.Cause) -> None:
        if run_id is None or parent is None:
            raise UnparseableCommand(f"{code}: {error}")
        rejection = decide.reject_run(run_id, parent, agent_type if isinstance(agent_type, str)
                                      else None, code, error, cause)
        await self._log.append(rejection, expected_last_seq=None)

    # --- cancel and clear ---------------------------------------------------------------

    async def cancel(self, payload: Payload, seq: int) -> str | None:
        """Cancel a run, and first its open descendants (the runs it started, and
        theirs), deepest first, so nothing it delegated outlives it.

        Two passes: every run of the tree is marked `run.cancel_requested` (deepest
        first) before any of them is stopped, so a run whose child ends `aborted` finds
        its own cancel in the log and stops too, instead of going on without the child
        (`RunContext.run_agent_tool`).
        """
        command = self._parse(CancelCommand, "cancel", payload)
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        current = (await self._log.read_run(command.parent, command.run_id)).state
        tree: list[TreeCancel] = []
        if current is not None and current.is_open:
            tree = cancels_below(await descendants(self._log, current, open_only=True), cause)
        tree.append(TreeCancel(command.parent, command.run_id, cause, None))
        state = await cancel_tree(self._log, tree, signal=self._signal_cancel,
                                  deliver=self._deliver)
        return state.status if state is not None else None

    async def _deliver(self, state: RunState | None, appended: list[Event]) -> None:
        """The hook of an outcome just appended; when nothing was (this command again,
        after a parent that appended it died before delivering), what the run still owes."""
        if self._deliverer is not None:
            await self._deliverer.deliver_after(state, appended)

    async def _down(self, parent: ParentRef, run_id: str,
                    below: list[str]) -> tuple[ParentRef, str] | None:
        """The run `below` leads to from `run_id` of `parent`, down its tree (each run the
        parent of the next); None when a run on the way is not there."""
        for next_id in below:
            above = (await self._log.read_run(parent, run_id)).state
            if above is None:
                return None
            parent, run_id = above.as_parent(), next_id
        return parent, run_id

    async def continue_run(self, payload: Payload, seq: int) -> str:
        """Answers to a paused run resume it in whichever runner picks the work up."""
        command = self._parse(ContinueCommand, "continue", payload)
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        if (target := await self._down(command.parent, command.run_id, command.below)) is None:
            return "no such run"
        parent, run_id = target
        state, appended = await self._log.recent.update(parent, run_id,
                                                 lambda s: decide.resume(s, command, cause))
        if appended and state is not None:
            await self._publish_work(state, dispatch=len(state.resumptions), why="resume")
            return "resumed"
        if state is None:
            return "no such run"
        history = await self._log.read_run(parent, run_id)
        if any(e.event_id == cause.event_id(run_id, "resumed", parent) for e in history.events):
            return "already resumed"  # this very command, delivered again
        why = (f"run {run_id!r} is not waiting for input "
               f"(it is {state.status}{', not paused' if state.is_open else ''})")
        await self._reject(run_id, parent, state.agent_type, "not-paused", why, cause)
        return "not paused"

    async def send(self, payload: Payload, seq: int, *, overdue: int | None = None) -> str:
        """A steering message: recorded in the run's log once per message id, then the
        runner holding the run is nudged to hand it to the child. A run that takes no
        message (ended, being cancelled, not there) refuses it on its subject, saying
        why, where the sender awaits the answer; so does a message past its expiry."""
        command = self._parse(SendCommand, "send", payload)
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        if (target := await self._down(command.parent, command.run_id, command.below)) is None:
            await self._reject(command.run_id, command.parent, None, "no-such-run",
                               f"no run {command.run_id!r} with runs {command.below} below it",
                               cause)
            return "no such run"
        parent, run_id = target
        if overdue is not None:
            assert command.expires_in_ms is not None
            waited_s = (command.expires_in_ms + overdue) / 1000
            await self._reject(run_id, parent, None, "expired",
                               f"the message waited {waited_s:.1f}s for a parent service, "
                               f"longer than its expires_in_ms ({command.expires_in_ms}): "
                               "not applied", cause)
            return "expired"
        state, appended = await self._log.recent.update(
            parent, run_id, lambda s: decide.send_message(s, command, cause))
        if appended and state is not None:
            signal = MessageSignal(run_id=run_id, parent=parent)
            await self._log.notify(self._subjects.message_signal(state.agent_type),
                                   signal.model_dump_json().encode())
            return "sent"
        if state is not None and state.message(command.message_id) is not None:
            return "already sent"
        await self._reject(run_id, parent, state.agent_type if state else None, "not-running",
                           decide.why_not_sent(state, run_id), cause)
        return "refused"

    async def message(self, payload: Payload) -> str:
        """A user message goes on the conversation's chat subject, once per message id."""
        command = self._parse(MessageCommand, "message", payload)
        chat = ChatKey(command.parent)
        if command.run_id is not None:
            state = (await self._log.read_run(command.parent, command.run_id)).state
            chat = (chat_of(state) if state is not None
                    else chat_of_new_run(command.parent, command.run_id))
        message = ChatMessage(id=user_message_id(chat, command.message_id), role="user",
                              content=command.content,
                              metadata={**command.metadata, "source": "user", "kind": "message"})
        ack = await self._log.publish(self._subjects.chat(*chat),
                                      message.model_dump_json().encode(),
                                      headers={"Nats-Msg-Id": message.id},
                                      stream=self._subjects.chat_stream)
        return "duplicate" if ack.duplicate else "posted"

    async def record_delivery(self, payload: Payload) -> str:
        """Record each delivery the command reports; what became of them, as one word
        ("appended") or, for several, each word and how many had it ("appended x3")."""
        command = self._parse(DeliveredCommand, "delivered", payload)
        reports = command.reports()
        if len(reports) == 1:
            return await self._record_delivery(command)
        # Each report is a fact of its own run, so they land side by side.
        results = Counter(await asyncio.gather(*map(self._record_delivery, reports)))
        return ", ".join(f"{result} x{count}" for result, count in sorted(results.items()))

    async def _record_delivery(self, command: DeliveredCommand) -> str:
        if (entry := delivery_entry_of_report(command, self._clock.now())) is not None:
            # The entry names the run's life, so it is appended as a fact, without
            # reading the run: the log drops a repeat inside its duplicate window, and the
            # fold ignores a later repeat and an earlier life's entry.
            await self._log.append(entry, expected_last_seq=None)
            return "appended"
        state, appended = await self._log.recent.update(
            command.parent, command.run_id,
            lambda s: record_delivery_of_this_life(s, command, self._clock.now()))
        if appended:
            return "recorded"
        if state is not None and not names_this_life(command.message_id, state, command.status,
                                                     command.method):
            return "a cleared earlier run's"
        return "already recorded"

    async def clear(self, payload: Payload, seq: int) -> list[str]:
        """Clear the parent's runs that match, each with its descendants (the runs it
        started, and theirs), so nothing of a cleared tree is left open or stored.

        Every open run of a tree is first marked `run.cancel_requested` (deepest first,
        as a cancel does: a run whose child ends `aborted` stops too instead of going on
        without it), then each is cleared, deepest first and the run itself last: an
        open one aborted (its outcome's hook delivered), its events purged to its
        `run.cleared` tombstone, its progress and its chat purged, its cap slot released.
        """
        command = self._parse(ClearCommand, "clear", payload)
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        cleared = []
        for run_id in await self._run_ids(command.parent):
            state = (await self._log.read_run(command.parent, run_id)).state
            if state is None or not decide.matches_clear(state, command.status,
                                                         command.older_than, clear_seq=seq):
                continue
            below = await descendants(self._log, state, open_only=False)
            tree = [(child, decide.cascade(cause, child)) for child in below]
            tree.append((state, cause))
            for run, mine in tree:
                if run.is_open:
                    await self._log.recent.update(run.parent, run.run_id, partial(
                        decide.request_cancel, cause=mine, reason="cleared"))
            for run, mine in tree[:-1]:
                await self._clear_run(run, mine)
            if await self._clear_run(state, cause):
                cleared.append(run_id)
        return cleared

    async def _clear_run(self, state: RunState, cause: decide.Cause) -> bool:
        """Clear this life of the run; False when it was cleared and requested again
        meanwhile (the new run is not the clear's)."""
        parent, run_id = state.parent, state.run_id
        if state.is_open:
            await self._signal_cancel(state)
        after, appended, last_seq = await self._log.recent.update_at(
            parent, run_id, _clear_life(state.incarnation, cause))
        if after is not None:
            return False
        # An open run is aborted before it is cleared: that outcome's hook is owed.
        if aborted := appended[:-1]:
            await self._deliver(fold(aborted, state), aborted)
        # Keep only the tombstone (ours or another clear's, the last event now), so a
        # rebuild does not bring the run back: everything before it, not "all but the
        # last", since the run id may be requested again at once.
        await self._log.purge(self._subjects.events_stream,
                              self._subjects.run_events(parent, run_id), keep_from_seq=last_seq)
        await self._log.purge(self._subjects.progress_stream,
                              self._subjects.run_progress(parent, run_id))
        # Its chat too (a conversation's messages): a new life of the run id starts empty.
        await self._log.purge(self._subjects.chat_stream,
                              self._subjects.chat(*chat_of(state)))
        if self._slots is not None:
            await self._slots.release(parent, run_id)
        return True

    async def _run_ids(self, parent: ParentRef) -> list[str]:
        return await self._log.run_ids(parent)

    async def _signal_cancel(self, state: RunState) -> None:
        signal = CancelSignal(run_id=state.run_id, parent=state.parent, reason="cancelled")
        await self._log.notify(self._subjects.cancel_signal(state.agent_type),
                               signal.model_dump_json().encode())

    def _parse(self, model: type, kind: str, payload: Payload):
        try:
            command = parse_command(kind, _json_object(payload))
        except (ValidationError, ValueError) as error:
            raise UnparseableCommand(f"invalid {kind} command: {_explain(error)}") from None
        assert isinstance(command, model)
        return command


def _clear_life(incarnation: str, cause: decide.Cause) -> Callable[[RunState | None], list[Event]]:
    """Clear the run if it is still the life the clear matched."""
    def clear(state: RunState | None) -> list[Event]:
        if state is None or state.incarnation != incarnation:
            return []
        return decide.clear(state, cause)
    return clear


def _json_object(payload: Payload) -> dict[str, Any]:
    if isinstance(payload, dict):
        return payload  # parsed by the service already
    try:
        value = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UnparseableCommand(f"not JSON: {error}") from None
    except RecursionError:
        raise UnparseableCommand("not JSON this service can read: nested too deeply") from None
    if not isinstance(value, dict):
        raise UnparseableCommand(f"a command is a JSON object, not {type(value).__name__}")
    return value


def _answerable(raw: dict[str, Any]) -> tuple[str | None, ParentRef | None]:
    """The run id and parent of a request that failed validation, when both are valid."""
    try:
        run_id = check_identifier(raw.get("run_id"), "run id")
        parent = msgspec.convert(raw.get("parent"), ParentRef)
    except ValueError:  # an InvalidIdentifier or msgspec's ValidationError
        return None, None
    return run_id, parent


def _explain(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}"
                         for e in error.errors()[:5])
    return str(error)

