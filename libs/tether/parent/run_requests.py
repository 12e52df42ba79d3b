"""The parent's handler of the `run` command (`RunRequests`, the base of
`CommandHandlers`): requests of new runs (forks among them), a run id requested again,
follow-up turns and rewinds.

It parses the command, loads the run from the log, decides with the pure functions of
`tether.domain` (`decide.request_run`, `turn_decisions`, `recovery_decisions.reattach`,
`spending`), and appends with optimistic concurrency (`EventLog.update`), so concurrent
requests for one run id on any number of parent replicas converge on one child turn.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import ValidationError

from tether.agent_registry import AgentRegistry
from tether.contract.messages import RUN_SEQUENCE_HEADER, WorkItem, work_item_json
from tether.domain import decide, forks, recovery_decisions, spending, turn_decisions
from tether.domain.amounts import Amount
from tether.domain.chat import started_by_error
from tether.domain.commands import RunCommand, parse_command
from tether.domain.events import ForkOrigin, ParentRef, RunRef, RunRequested
from tether.domain.ids import work_message_id
from tether.domain.run_state import RunState
from tether.domain.spending import BUDGET_EXCEEDED
from tether.parent import branching
from tether.parent.command_parsing import (
    Payload,
    UnparseableCommand,
    answerable,
    explain,
    json_object,
)
from tether.parent.slots import SlotKeeper
from tether.ports import SYSTEM_CLOCK, Clock, Decide, EventLog


@dataclass(frozen=True)
class RunOutcome:
    """What a run request came to, for logs and tests."""

    # created | rejected | existing | reattached | redispatched | taken (the run id names
    # another request's run: `decide.taken_by_another`)
    decision: str
    status: str | None = None
    code: str | None = None


class RunRequests:
    """The `run` command's handler: a run requested (validated against the agent
    registry, given its cap slot and its share of the budgets above it, appended and
    dispatched), one requested again (told, re-dispatched or re-attached to), and a
    follow-up turn of a finished run. `CommandHandlers` handles the other commands."""

    def __init__(self, log: EventLog, agents: AgentRegistry, *, budgets: decide.Budgets,
                 slots: SlotKeeper | None, default_cap: int | None, max_input_bytes: int,
                 hook_registered, clock: Clock = SYSTEM_CLOCK) -> None:
        """`clock`: the time of the causes of what they decide."""
        self._log = log
        self._subjects = log.subjects
        self._agents = agents
        self._budgets = budgets
        self._slots = slots
        self._default_cap = default_cap
        self._max_input_bytes = max_input_bytes
        self._hook_registered = hook_registered
        self._clock = clock

    def cap_for(self, parent: ParentRef) -> int | None:
        """The parent's cap: its own class attribute when it is a child agent, else the service's."""
        agent = self._agents.get(parent.agent)
        if agent is not None and agent.max_concurrent_agent_tools is not None:
            return agent.max_concurrent_agent_tools
        return self._default_cap

    async def run(self, payload: Payload, seq: int, *, overdue: int | None = None) -> RunOutcome:
        """`overdue`: by how many ms the request is past its expiry (None: it is not)."""
        cause = decide.Cause(command_seq=seq, now=self._clock.now())
        raw = json_object(payload)
        try:
            command = parse_command("run", raw)
        except (ValidationError, ValueError) as error:
            run_id, parent = answerable(raw)
            await self._reject(run_id, parent, raw.get("agent_type"), "invalid-request",
                               explain(error), cause)
            return RunOutcome("rejected", code="invalid-request")
        if not command.plain and (handled := await self._other_kind(command, cause,
                                                                    overdue)) is not None:
            return handled
        if overdue is not None:
            return await self._expired(command, overdue, cause)

        problem, fork = await self._validate_request(command)
        spend = await self._spend(command) if problem is None else decide.NO_SPEND
        cap = self.cap_for(command.parent)
        takes_slot = cap is not None and self._slots is not None
        if problem is None and not takes_slot and not spend.above:
            # Most run ids are new: the request is appended expecting the run's subject
            # empty, without reading it first; when it is not, the run is read and
            # answered as below.
            requested = decide.request_run(command, self._budgets, cause, spend, fork)
            if (created := await self._log.append_new(requested)) is not None:
                state, requested_seq = created
                await self._dispatch(state, requested, requested_seq)
                return RunOutcome("created", status="starting")

        history = await self._log.read_run(command.parent, command.run_id)
        if history.state is not None:
            return await self._existing(command, history.state, history.last_seq, cause)
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
        return await self._create(command, cause, spend, fork)

    async def _other_kind(self, command: RunCommand, cause: decide.Cause,
                          overdue: int | None) -> RunOutcome | None:
        """A follow-up or a rewind, handled; a request of two kinds, refused; None for a
        fork, which is requested as any new run."""
        if (mixed := command.mixed()) is not None:
            await self._reject(command.run_id, command.parent, command.agent_type,
                               "invalid-request", mixed, cause)
            return RunOutcome("rejected", code="invalid-request")
        if command.turn is not None:
            return await self._follow_up(command, cause, overdue)
        if command.rewind is not None:
            return await self._rewind(command, cause, overdue)
        return None

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

    def _share(self, agent_type: str, max_tokens: int | None,
               max_cost: float | None) -> Amount:
        """What a run reserves of each budget above it: its own budget, else its agent
        type's estimate."""
        agent = self._agents.get(agent_type)
        return Amount(tokens=max_tokens or (agent.estimated_tokens if agent else 0),
                      cost=max_cost or (agent.estimated_cost if agent else 0.0))

    async def _reserve(self, command: RunCommand, spend: decide.Spend,
                       cause: decide.Cause) -> str | None:
        """Reserve the new run's share of every budget above it (`spending.reserve`); a
        share held already counts: this request's own (its command delivered again), or
        another request's for the same run id, which it then claims too. None when all
        had room, else why one had none."""
        share = self._share(command.agent_type, spend.max_tokens, spend.max_cost)
        run = RunRef(parent=command.parent, run_id=command.run_id)

        def why_not(owner: RunRef, state: RunState | None) -> str | None:
            if state is None:
                return f"the budgeted run {owner.run_id} above it is gone"
            if spending.holds(state, run):
                return None
            return spending.room_for(state, share) or f"run {owner.run_id} had no room"

        return await self._reserve_above(
            spend.above, run, partial(spending.reserve, run=run, amount=share, cause=cause),
            why_not, cause)

    async def _reserve_turn(self, state: RunState, cause: decide.Cause) -> str | None:
        """Reserve the share of every budget above a nested run for its new turn (a
        follow-up, a rewind), as its first turn reserved it: the last turn's share was
        freed as it ended (`spending.reserve_turn`). None when all had room (or it has no
        open budget above it), else why one had none."""
        share = self._share(state.agent_type, state.max_tokens, state.max_cost)
        run = RunRef(parent=state.parent, run_id=state.run_id)
        steps = spending.paid_here(state)

        def why_not(owner: RunRef, budget: RunState | None) -> str | None:
            return spending.why_no_turn_share(budget, run, share, steps, cause)

        return await self._reserve_above(
            state.budgets_above, run,
            partial(spending.reserve_turn, run=run, amount=share, steps=steps, cause=cause),
            why_not, cause)

    async def _reserve_above(self, above: tuple[RunRef, ...], run: RunRef, reserve: Decide,
                             why_not: Callable[[RunRef, RunState | None], str | None],
                             cause: decide.Cause) -> str | None:
        """`reserve` on every budgeted run `above` the run, nearest first; None when each
        reserved or had no need to (`why_not` None), else why one could not. This
        request's claims on the others are then withdrawn (`spending.withdraw`): a share
        another request for the same run id claims too stays held for the run that one
        may start, and one this request's command reserved in an earlier delivery (a
        parent that died after reserving) is freed."""
        for index, budget in enumerate(above):
            state, appended = await self._log.recent.update(budget.parent, budget.run_id,
                                                            reserve)
            if appended or (why := why_not(budget, state)) is None:
                continue
            for other in above[:index] + above[index + 1:]:
                await self._log.recent.update(
                    other.parent, other.run_id,
                    partial(spending.withdraw, run=run, cause=cause))
            return why
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
        begin_turn = partial(turn_decisions.request_turn, command=command,
                             budgets=self._budgets, accepts=accepts, cause=cause)
        if problem is None:
            problem = await self._new_turn_share(command, begin_turn, cause)
        state, appended, last_seq = await self._log.recent.update_at(
            command.parent, command.run_id, begin_turn if problem is None else decide.nothing)
        if appended and state is not None:
            await self._publish_work(state, dispatch=1, why=f"turn{command.turn}")
            return RunOutcome("created", status="starting")
        why = (problem[1] if problem is not None
               else turn_decisions.why_no_turn(state, command, accepts))
        if why is None and state is not None:  # the same follow-up again
            if state.turn == command.turn and state.status == "starting":
                await self._publish_work(state, dispatch=1, why=f"turn{command.turn}")
            await self._tell_existing(state, last_seq)
            return RunOutcome("existing", status=state.status)
        code = problem[0] if problem is not None else "no-follow-up"
        await self._reject(command.run_id, command.parent, command.agent_type, code,
                           why or "not applied", cause)
        return RunOutcome("rejected", code=code)

    async def _new_turn_share(self, command: RunCommand, begin_turn: Decide,
                              cause: decide.Cause) -> tuple[str, str] | None:
        """A nested run's new turn (`begin_turn`: the decision that appends it) reserves
        its share of the budgets above it first; the refusal when one has no room. None
        when it did, or there is no new turn to begin (the decision that appends it says
        why), or no budget above."""
        state = (await self._log.read_run(command.parent, command.run_id)).state
        if state is None or not state.budgets_above or not begin_turn(state):
            return None
        why = await self._reserve_turn(state, cause)
        return None if why is None else (BUDGET_EXCEEDED, why)

    async def _rewind(self, command: RunCommand, cause: decide.Cause,
                      overdue: int | None) -> RunOutcome:
        """Rewind `command.rewind` of a failed run: appended and dispatched when it is the
        next one; the same rewind asked again is told the run; refused, saying why."""
        if overdue is not None:
            return await self._expired(command, overdue, cause)
        assert command.rewind is not None
        problem = await self._new_turn_share(command, partial(
            forks.rewind, cause=cause, budgets=self._budgets, number=command.rewind), cause)
        if problem is not None:
            await self._reject(command.run_id, command.parent, command.agent_type, *problem,
                               cause)
            return RunOutcome("rejected", code=problem[0])
        state, appended, last_seq, refused = await branching.rewind(
            self._log, command, cause, self._budgets)
        if appended and state is not None:
            await self._publish_work(state, dispatch=1, why=f"rewind{state.rewinds}")
            return RunOutcome("created", status="starting")
        if refused is None and state is not None:  # the same rewind again
            if state.rewinds == command.rewind and state.status == "starting":
                await self._publish_work(state, dispatch=1, why=f"rewind{state.rewinds}")
            await self._tell_existing(state, last_seq)
            return RunOutcome("existing", status=state.status)
        code, why = (refused.code, str(refused)) if refused else ("not-failed", "not applied")
        await self._reject(command.run_id, command.parent, command.agent_type, code, why, cause)
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
                      spend: decide.Spend = decide.NO_SPEND,
                      fork: ForkOrigin | None = None) -> RunOutcome:
        requested = decide.request_run(command, self._budgets, cause, spend, fork)
        state, appended, requested_seq = await self._log.recent.update_at(
            command.parent, command.run_id, partial(decide.create, requested=requested))
        assert state is not None  # ours, or another replica's created between read and append
        if not appended:
            return await self._existing(command, state, requested_seq, cause)
        await self._dispatch(state, requested, requested_seq)
        return RunOutcome("created", status="starting")

    async def _existing(self, command: RunCommand, state: RunState, seq: int,
                        cause: decide.Cause) -> RunOutcome:
        """A repeated run id never starts a second child turn. The requester is told the
        run exists (`_tell_existing`), since what this appends may be nothing; its client
        answers a request that is not a repeat of that run (`decide.taken_by_another`)
        with why, and the parent does nothing else for it: no re-dispatch, no re-attach."""
        if decide.taken_by_another(state, command) is not None:
            await self._tell_existing(state, seq)
            return RunOutcome("taken", status=state.status)
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
                state.parent, state.run_id, partial(recovery_decisions.reattach, cause=cause))
            if not appended:  # given up for good (`RunState.resumable`), or repaired
                return RunOutcome("existing", status=state.status)
            if after is not None and not after.child_still_running:
                # Nobody is running the child: hand it to a runner, which resumes the
                # same turn after what was recorded.
                await self._publish_work(after, dispatch=after.reattach_attempts, why="reattach")
            return RunOutcome("reattached", status="interrupted")
        return RunOutcome("existing", status=state.status)

    async def _validate_request(self, command: RunCommand
                                ) -> tuple[tuple[str, str] | None, ForkOrigin | None]:
        """Why the request is refused (None: it is not), and a fork's origin."""
        problem = await self._validate(command)
        if command.fork is None or problem is not None:
            return problem, None
        fork, problem = await branching.fork_origin(self._log, self._agents, command)
        return problem, fork

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
            return ("invalid-input", f"input for {command.agent_type}: {explain(error)}")
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
