"""The reconciler: detached budgets, recovery of runs whose awaiter is gone, delivery retries.

One reconciler is active at a time (a lease: a Postgres session advisory lock, confirmed
while held, see `tether.leadership`); a standby takes over when the active one's session
ends, and an active one that loses its lease or a dependency stands by again. On becoming active it loads the
runs it must watch from the projection, with the checkpoint they are consistent with,
then follows the log from there, so its view is the projection plus the tail of the log.

A give-up's hook goes out right after its interruption is appended; a hook or
notification not acknowledged within its lease is published again.

Deadlines (absolute budget, no-progress budget, delivery retries) live in a
`DeadlineIndex`, on the broker's clock: they count from the stored time of the events
they start at (`StoredEvent.logged_at`) and fall due by `BrokerClock.now()`, so a
service whose wall clock is off changes no outcome. The timer sleeps until the earliest
one, so a deadline fires when it falls due and a tick costs in proportion to the due
runs. A give-up is appended (and its hook delivered) first; the cancel to the child's
runner follows, without waiting for its answer. Every decision re-reads the
run from the log and appends with optimistic concurrency, so a decision taken twice
(two reconcilers for a moment, a restart mid-decision) lands once.
"""

import asyncio
import uuid
from collections.abc import Callable
from contextlib import aclosing, suppress
from functools import partial
from typing import cast

import asyncpg

from tether.adapters.broker_clock import BrokerClock
from tether.adapters.control import control_broker
from tether.adapters.event_log import EventLog, until_stopped
from tether.adapters.postgres.committed_feed import CommittedFeed, FeedSubscription
from tether.adapters.postgres.reads import ProjectionReads
from tether.config import Settings
from tether.contract.messages import LifecycleResult
from tether.delivery.deliverer import Deliverer
from tether.domain import budgets, decide, recovery_decisions, spending
from tether.domain.amounts import key_of, step_amount
from tether.domain.events import (
    TERMINAL_EVENT_STATUS,
    Event,
    InterruptedReason,
    ParentRef,
    RunRef,
    RunRequested,
    RunStepRecorded,
)
from tether.domain.evolved import Evolved
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.leadership import LeadershipLost, Lease, act_while_leading
from tether.metrics import (
    DEADLINES_DUE,
    DEADLINES_FIRED,
    DECISIONS_FAILED,
    DELIVERIES_RETRIED,
    HANDLER_SECONDS,
)
from tether.ports import SYSTEM_CLOCK, StoredEvent
from tether.reconciler.deadlines import DeadlineIndex
from tether.reconciler.recovery import Recovery
from tether.reconciler.runners import ChildControl, Observability
from tether.resilience import TRANSIENT_ERRORS, describe, is_transient, supervise, unless_stopped
from tether.run_tree import cancel_below

RunKey = tuple[str, str, str]
# A run's deadlines: its time budgets', a delivery's retry, and "spent", due at once
# when its token or cost budget was passed.
_KINDS = (*budgets.KINDS, "delivery", "spent")

# The events of a run with budgets above it that the budgets count: its model steps, and
# its end.
_SPENDING_EVENTS = frozenset({"run.step_recorded", *TERMINAL_EVENT_STATUS})
# The events after which a run below a budget holds its share again: a re-attach, and a
# new turn whose share the parent reserved before its last turn was settled here.
_HOLDING_AGAIN_EVENTS = frozenset({"run.reattach_started", "run.turn_requested",
                                   "run.rewound"})

# A batch of the log not yet full waits this long for more. Each batch costs a few turns
# of the loop whatever its size; under load, waiting gathers the events of many runs
# into one, and no deadline is that tight.
FOLLOW_LINGER_S = 0.02
# How long the timer waits for the broker's clock before it falls back to its own.
FIRST_SAMPLE_WAIT_S = 10.0



class Reconciler:
    def __init__(self, settings: Settings, log: EventLog, pool: asyncpg.Pool,
                 deliverer: Deliverer, logger, clock: BrokerClock | None = None,
                 feed: CommittedFeed | None = None) -> None:
        """`clock`: the broker's, as the service samples it; None: the reconciler samples
        one of its own while it runs. `feed`: the batches the projector of this process
        commits, taken instead of the log's while that projector leads."""
        self._settings = settings
        self._log = log
        self._feed = feed
        # Where the log comes from while it leads: "projector" (`feed`) or "log" (the broker).
        self.following: str | None = None
        self._pool = pool
        self._logger = logger
        self._deliverer = deliverer
        # Distinguishes this reconciler's decisions from another's (see decide.Cause).
        self.origin = f"rec-{uuid.uuid4().hex[:8]}"
        self._control = ChildControl(log.nats, log.subjects)
        self._observability_broker = control_broker(settings, "tether-reconciler-observability")
        self.observability = Observability(self._observability_broker, log.subjects, logger)
        self.recovery = Recovery(settings, log, self._control, self.observability, logger,
                                 origin=self.origin)
        self.recovery.deliver_after = deliverer.deliver_after
        self._states: dict[RunKey, RunState] = {}
        self._index = DeadlineIndex()
        self._changed = asyncio.Event()
        self._armed_due: int | None = None  # what the timer sleeps until
        self._delivery_attempts: dict[RunKey, int] = {}
        self._in_flight: set[tuple[RunKey, str]] = set()
        self._firing: set[asyncio.Task[None]] = set()
        self.active = asyncio.Event()
        self.decisions = 0
        self._own_clock = clock is None
        self._clock = clock or BrokerClock(log.nats, log.subjects.events_stream, logger,
                                           warn_skew_ms=settings.clock_skew_warn_ms)

    def budget_totals(self) -> dict[tuple[str, str], float]:
        """(kind, state) -> the sum over the open runs with a budget of that kind that this
        reconciler watches: spent, reserved and left (`tether_budgets`)."""
        totals = {(kind, state): 0.0 for kind in ("tokens", "cost")
                  for state in ("spent", "reserved", "left")}
        for run in self._states.values():
            if not run.is_open or not spending.has_budget(run):
                continue
            used, held = spending.spent(run), spending.reserved(run)
            tokens, cost = spending.left(run)
            if tokens is not None:
                totals[("tokens", "spent")] += used.tokens
                totals[("tokens", "reserved")] += held.tokens
                totals[("tokens", "left")] += max(tokens, 0)
            if cost is not None:
                totals[("cost", "spent")] += used.cost
                totals[("cost", "reserved")] += held.cost
                totals[("cost", "left")] += max(cost, 0.0)
        return totals

    def tracking(self, parent: ParentRef, run_id: str) -> bool:
        """Whether this reconciler still watches the run: a deadline of it pending or a
        decision about it under way."""
        key = (parent.agent, parent.name, run_id)
        return key in self._states or any(in_flight == key for in_flight, _ in self._in_flight)

    @property
    def lock_key(self) -> str:
        return f"tether-reconciler:{self._settings.prefix}"

    async def run(self, stop: asyncio.Event) -> None:
        """Stand by, lead while the lease holds, and stand by again when it is lost or a
        dependency fails (see `tether.leadership`)."""
        leading = supervise("reconciler", lambda progressed: self._lead(stop, progressed),
                            stop, self._logger)
        if not self._own_clock:
            await leading
            return
        await asyncio.gather(leading, self._clock.run(stop))

    async def _lead(self, stop: asyncio.Event, progressed) -> None:
        lease = Lease(self._pool, self.lock_key, self._logger,
                      check_interval_s=self._settings.leadership_check_ms / 1000)
        async with lease.held(stop) as term:
            if term is None:
                return
            # The gate before each decision, the timer's (`_fire`) and recovery's.
            self._lease_fresh = self.recovery.lease_fresh = term.fresh
            started, _ = await unless_stopped(stop, self._observability_broker.start())
            if not started:
                return  # stopped while the broker's connection waited for NATS
            progressed()
            self._reset_view()
            self.active.set()
            self._logger.info("reconciler.active")
            try:
                await act_while_leading(term, stop, self._act)
            except LeadershipLost:
                return  # logged (`leadership.lost`); it stands by again
            finally:
                self.active.clear()
                for task in list(self._firing):
                    task.cancel()
                with suppress(*TRANSIENT_ERRORS):
                    await self._observability_broker.stop()

    async def _act(self, stop: asyncio.Event) -> None:
        # Taken before the view is loaded: what the projector commits after the load's
        # checkpoint is then in the subscription (what it committed before, skipped).
        fed = self._feed.subscribe() if self._feed is not None else None
        try:
            checkpoint = await self._load()
            await asyncio.gather(self._follow(stop, checkpoint, fed), self._timer(stop),
                                 self.recovery.run(stop, self._awaited_open_runs))
        finally:
            if fed is not None:
                fed.close()

    def _reset_view(self) -> None:
        """A new term starts from the projection again: what the last one knew may be
        stale by the time this instance leads."""
        self._states.clear()
        self._index = DeadlineIndex()
        self._delivery_attempts.clear()
        self._in_flight.clear()
        self._armed_due = None

    def _awaited_open_runs(self) -> list[RunState]:
        """Recovery's rows: awaited runs a child should be working on (a paused run waits
        for a human, not for a child)."""
        return [s for s in self._states.values()
                if s.is_open and s.detached is None and s.paused is None]

    # --- the view: projection, then the log -----------------------------------------

    async def _load(self) -> int:
        try:
            checkpoint, watched = await ProjectionReads(
                self._pool, self._settings.projection_schema).watched()
        except asyncpg.UndefinedTableError:
            return 0  # no projection yet: the log from the start is the view
        for state in watched:
            self._track(state)
            if state.is_open and spending.has_budget(state) and spending.exceeded(state):
                # Passed while no reconciler led: given up now.
                self._index.set(((state.parent.agent, state.parent.name, state.run_id),
                                 "spent"), self._clock.now())
        self._logger.info("reconciler.loaded", runs=len(watched), watching=len(self._states),
                          checkpoint=checkpoint)
        return checkpoint

    async def _follow(self, stop: asyncio.Event, position: int,
                      fed: FeedSubscription | None = None) -> None:
        """The log after `position`: from the projector of this process while it leads
        and has committed up to here (`fed`), from the broker otherwise, switching
        between the two without a gap or a repeat."""
        while not stop.is_set():
            if fed is not None and fed.start <= position:
                position = await self._take(fed, stop, position)
                if not stop.is_set():
                    self._logger.info("reconciler.following_log", after_seq=position,
                                      reason=fed.end_reason)
                fed = None
                continue
            position, fed = await self._follow_log(stop, position, fed)

    async def _take(self, fed: FeedSubscription, stop: asyncio.Event, position: int) -> int:
        """The subscription's batches until it ends; returns the last sequence observed."""
        self._logger.info("reconciler.following_projector", after_seq=position)
        self.following = "projector"
        try:
            async for batch in until_stopped(fed.batches(), stop):
                position = await self._observe_batch(batch.events, position,
                                                     batch.evolutions)
        finally:
            self.following = None
            fed.close()
        return position

    async def _follow_log(self, stop: asyncio.Event, position: int,
                          fed: FeedSubscription | None) -> tuple[int, FeedSubscription | None]:
        """The log from the broker, until `stop`, or until the projector of this process
        leads and its subscription covers what follows `position`."""
        batches = self._log.follow_batches(self._log.subjects.all_events,
                                           start_seq=position + 1, max_batch=1000,
                                           linger=FOLLOW_LINGER_S)
        self.following = "log"
        try:
            async with aclosing(until_stopped(batches, stop)) as followed:
                async for batch in followed:
                    position = await self._observe_batch(batch, position)
                    if fed is None and self._feed is not None:
                        fed = self._feed.subscribe()
                    if fed is not None and fed.end_reason is not None:
                        fed = None  # (it ended before it was taken: the broker's log goes on)
                    elif fed is not None and fed.start <= position:
                        break
        finally:
            self.following = None
        return position, fed

    async def _observe_batch(self, batch: list[StoredEvent], position: int,
                             evolutions: list[Evolved | None] | None = None) -> int:
        """`evolutions`: the projector's fold step of each event, when it made them."""
        for index, stored in enumerate(batch):
            # (At or before `position`: observed already, or in the loaded view.)
            if stored.seq > position and stored.event is not None:
                await self._observe(stored.event, stored.seq, stored.logged_at,
                                    None if evolutions is None else evolutions[index])
        return max(position, batch[-1].seq) if batch else position

    async def _observe(self, event, seq: int, logged_at: int | None,
                       evolved: Evolved | None = None) -> None:
        """`evolved`: the run after `event` as the projector folded it (None: folded here)."""
        key = (event.parent.agent, event.parent.name, event.run_id)
        state = self._states.get(key)
        if state is None and not isinstance(event, RunRequested):
            if event.type not in ("run.completed", "run.failed", "run.aborted",
                                  "run.interrupted", "run.reattach_started",
                                  "run.turn_requested", "run.rewound"):
                return
            if evolved is None:
                # A run we stopped watching moved again (a late outcome repairing an
                # interrupted run, a re-attach, a follow-up turn, a rewind): read it once.
                state = (await self._log.read_run(event.parent, event.run_id,
                                                  before_seq=seq)).state
        if evolved is None:
            evolved = evolve(state, event, logged_at)
        if evolved.state is None:
            self._untrack(key)
            return
        self._track(evolved.state)
        if evolved.applied and (evolved.state.budgets_above
                                or spending.has_budget(evolved.state)):
            await self._count(event, evolved.state, key)
        if event.type == "run.reattach_started" and evolved.state.status == "interrupted":
            # A repeated request re-attached to an interrupted run: follow it again.
            self.recovery.watch(evolved.state, announce=False)

    async def _count(self, event: Event, state: RunState, key: RunKey) -> None:
        """Budgets in tokens and cost (`tether.domain.spending`): a model step of a run
        with budgets above it is charged to each; its end settles what it reserved there
        (and any charge a reconciler did not live to append); a budgeted run whose usage
        passed its budget is due to be given up."""
        if state.budgets_above and event.type in _SPENDING_EVENTS:
            run = RunRef(parent=state.parent, run_id=state.run_id)
            cause = decide.timer_cause(SYSTEM_CLOCK.now(), self.origin)
            if isinstance(event, RunStepRecorded):
                used = step_amount(event.data.step)
                decision = partial(spending.charge, run=run, step=event.data.index,
                                   amount=used, cause=cause) if used else None
            else:
                decision = partial(spending.settle, run=run, steps=spending.paid_here(state),
                                   cause=cause)
            if decision is not None:
                await self._charge(state, decision)
        if state.budgets_above and event.type in _HOLDING_AGAIN_EVENTS:
            await self._reserve_again(state)
        if (state.is_open and event.type in ("run.step_recorded", "run.usage_charged")
                and spending.exceeded(state) is not None):
            self._index.set((key, "spent"), self._clock.now())
            self._rearm()

    async def _reserve_again(self, state: RunState) -> None:
        """A run re-attached after its interruption released its shares, or one whose new
        turn reserved its shares before this settled its last turn (which released
        them again): each budget above holds its share again (`spending.reserve_again`),
        or says it does not. Events observed again after a restart come in order: a
        share held again here for a run that had ended is released again as its end is
        observed again after it."""
        run = RunRef(parent=state.parent, run_id=state.run_id)
        decision = partial(spending.reserve_again, run=run,
                           cause=decide.timer_cause(SYSTEM_CLOCK.now(), self.origin))
        for owner in state.budgets_above:
            try:
                budget, _ = await self._log.recent.update(owner.parent, owner.run_id, decision)
            except Exception as error:
                if not is_transient(error):
                    raise
                self._logger.warning("reconciler.charge_failed", run_id=state.run_id,
                                     budget_of=owner.run_id, error=describe(error))
                continue
            share = None if budget is None else budget.spending.get(key_of(run))
            if budget is not None and budget.is_open and share is not None and \
                    share.released and share.reservations:
                self._logger.warning(
                    "budget.unreserved", run_id=state.run_id, budget_of=owner.run_id,
                    left=spending.left(budget),
                    detail="the run was re-attached without its share of this budget: "
                           "what it has not used does not fit what is left; its steps are "
                           "still charged")

    async def _charge(self, state: RunState,
                      decision: Callable[[RunState | None], list[Event]]) -> None:
        """Append `decision` to every budgeted run above `state`'s run."""
        for owner in state.budgets_above:
            try:
                await self._log.recent.update(owner.parent, owner.run_id, decision)
            except Exception as error:
                if not is_transient(error):
                    raise
                self._logger.warning("reconciler.charge_failed", run_id=state.run_id,
                                     budget_of=owner.run_id, error=describe(error))

    def _track(self, state: RunState) -> None:
        key = (state.parent.agent, state.parent.name, state.run_id)
        pending = self._pending_delivery(state)
        if not (state.is_open or pending):
            self._untrack(key)
            return
        self._states[key] = state
        watched = budgets.watched(state)
        for kind, field in budgets.FIELDS:  # (attributes read here: for every event)
            self._index.set((key, kind), getattr(state, field) if watched else None)
        if pending and self._index.get((key, "delivery")) is None:
            attempts = self._delivery_attempts.get(key, 0)
            # (`ended_at` is the writer's clock: never later than now on the broker's.)
            now = self._clock.now()
            self._index.set((key, "delivery"),
                            min(state.ended_at or now, now) + self._backoff(attempts))
        elif not pending:
            self._index.set((key, "delivery"), None)
        self._rearm()

    def _rearm(self) -> None:
        """Wake the timer only when a deadline is now earlier than the one it waits for
        (most signals move a far-off deadline later)."""
        due = self._index.next_due()
        if due is not None and (self._armed_due is None or due < self._armed_due):
            self._changed.set()

    def _untrack(self, key: RunKey) -> None:
        self._states.pop(key, None)
        self._delivery_attempts.pop(key, None)
        for kind in _KINDS:
            self._index.set((key, kind), None)

    def _pending_delivery(self, state: RunState) -> bool:
        options = state.detached
        if options is None or state.is_open:
            return False
        if state.status == "aborted" and state.aborted_cause == decide.GIVE_UP:
            return False
        if options.on_finish:
            return not state.finish_delivered(state.status, options.on_finish)
        if options.notify:
            return f"finish:{state.status}" not in state.ledger.notifications
        return False

    def _backoff(self, attempts: int) -> int:
        return min(self._settings.delivery_lease_ms * 2 ** attempts,
                   self._settings.delivery_max_backoff_ms)

    # --- the timer ------------------------------------------------------------------

    async def _timer(self, stop: asyncio.Event) -> None:
        # Deadlines fall due on the broker's clock. A broker that cannot be sampled (its
        # failures are logged, `clock.sample_failed`) leaves this process's own clock, not
        # a timer that never starts.
        with suppress(TimeoutError):
            async with asyncio.timeout(FIRST_SAMPLE_WAIT_S):
                await self._clock.sampled()
        while not stop.is_set():
            due_at = self._index.next_due()
            timeout = None if due_at is None else max(due_at - self._clock.now(), 0) / 1000
            self._armed_due = due_at
            self._changed.clear()
            waiters = [asyncio.ensure_future(self._changed.wait()),
                       asyncio.ensure_future(stop.wait())]
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            for due, _ in self._index.pop_due(self._clock.now()):
                key, kind = cast("tuple[RunKey, str]", due)  # the keys `_track` sets
                DEADLINES_DUE.inc(kind=kind)
                if (key, kind) not in self._in_flight:
                    self._in_flight.add((key, kind))
                    # Referenced until done: the loop keeps only a weak reference to a
                    # task, and a collected one would never decide its deadline. (And
                    # cancelled with the term.)
                    task = asyncio.create_task(self._fire(key, kind))
                    self._firing.add(task)
                    task.add_done_callback(self._firing.discard)

    async def _fire(self, key: RunKey, kind: str) -> None:
        clock = HANDLER_SECONDS.start()
        try:
            # The gate: decide only on a lease confirmed within its check interval (a
            # reconciler woken from a pause confirms it first). The decision is taken from
            # a read of the run made after it, and its appends expect that read's last
            # sequence: one that lands late lands only on the run it was decided from.
            await self._lease_fresh()
            if kind == "delivery":
                await self._retry_delivery(key)
            elif kind == "spent":
                await self._spent_due(key)
            else:
                await self._budget_due(key)
        except LeadershipLost:
            return  # the term is over (its work is being cancelled); the next one reloads
        except Exception as error:
            # Decided again in a second; a broker away for that long is not a bug.
            if is_transient(error):
                self._logger.warning("reconciler.decision_failed", run_id=key[2], kind=kind,
                                     error=describe(error), retry_in_s=1)
            else:
                self._logger.exception("reconciler.decision_failed", run_id=key[2], kind=kind)
            DECISIONS_FAILED.inc(kind=kind)
            self._index.set((key, kind), self._clock.now() + 1_000)
            self._rearm()
        finally:
            clock.observe(service="reconciler", handler=f"deadline.{kind}")
            self._in_flight.discard((key, kind))

    async def _budget_due(self, key: RunKey) -> None:
        state = self._states.get(key)
        if state is None:
            return
        state = (await self._log.read_run(state.parent, state.run_id)).state
        if state is None or not state.is_open or state.detached is None:
            if state is not None:
                self._track(state)
            return
        budget = budgets.run_out(state, self._clock.now())
        if budget is None:
            self._track(state)  # a signal moved the deadline since
            return
        await self._give_up(state, budget.reason,
                            recovery_decisions.INTERRUPTED_ERRORS[budget.reason], budget.kind)

    async def _spent_due(self, key: RunKey) -> None:
        """A run's token or cost budget was passed (`spending.exceeded`): give it up."""
        state = self._states.get(key)
        if state is None:
            return
        state = (await self._log.read_run(state.parent, state.run_id)).state
        if state is None or not state.is_open:
            return
        if (error := spending.exceeded(state)) is not None:
            await self._give_up(state, "budget-exceeded", error, "spent")

    async def _give_up(self, state: RunState, reason: InterruptedReason, error: str,
                       kind: str) -> None:
        """The run ends `interrupted` for `reason` (a budget), what it owes is delivered,
        the runs below it are cancelled deepest first, and its child is stopped."""
        # The child was at work when the parent stopped waiting (a runner had started an
        # attempt): the cancel to its runner follows the give-up, not before it.
        child_running = state.status == "running"
        cause = decide.timer_cause(SYSTEM_CLOCK.now(), self.origin)
        final, appended = await self._log.recent.update(
            state.parent, state.run_id,
            partial(recovery_decisions.give_up, cause=cause, reason=reason, error=error,
                    child_still_running=child_running))
        if final is not None:
            self._track(final)
        # Two deciders may each append part of a decision (one the cancel request, the
        # other the interruption); the one whose interruption landed owns the give-up.
        if any(event.type == "run.interrupted" for event in appended):
            # Counted as soon as it is in the log, before the delivery's round trips.
            self.decisions += 1
            DEADLINES_FIRED.inc(kind=kind)
            await self.observability.emit("agent_tool:detached:give_up", state.run_id,
                                          state.parent, reason=reason,
                                          child_still_running=child_running)
            # The interruption's hook or notification (the timer retries it if lost).
            await self._deliverer.deliver_after(final, appended)
            # What the run delegated stops with it, deepest first.
            await cancel_below(self._log, state, cause, f"its parent run gave up: {reason}",
                               signal=self._signal_descendant,
                               deliver=self._deliverer.deliver_after)
        if child_running and appended:
            # The request is in the log (its runner finds it at its next heartbeat); the
            # signal only makes the stop prompt. A result the child returns meanwhile
            # is recorded: a late completion repairs the interruption.
            await self._control.signal_cancel(state, decide.GIVE_UP)

    async def _signal_descendant(self, state: RunState) -> None:
        await self._control.signal_cancel(state, "cancelled")

    async def _retry_delivery(self, key: RunKey) -> None:
        """A finish hook or notification not confirmed within its lease is published again."""
        state = self._states.get(key)
        if state is None:
            return
        state = (await self._log.read_run(state.parent, state.run_id)).state
        if state is None or not self._pending_delivery(state):
            if state is not None:
                self._track(state)
            else:
                self._untrack(key)
            return
        attempts = self._delivery_attempts.get(key, 0) + 1
        DELIVERIES_RETRIED.inc()
        DEADLINES_FIRED.inc(kind="delivery")
        self._delivery_attempts[key] = attempts
        published = await self._deliverer.deliver_finish(state, LifecycleResult.of(state),
                                                         retry=attempts)
        if not published:  # the handler had delivered it: the ledger now says so
            final = (await self._log.read_run(state.parent, state.run_id)).state
            if final is not None:
                self._track(final)
            return
        assert state.detached is not None  # only a detached run's delivery is retried
        await self.observability.emit("agent_tool:detached:delivery_failed", state.run_id,
                                      state.parent, reason="not-acknowledged",
                                      status=state.status, attempts=attempts,
                                      method=state.detached.on_finish)
        self._index.set((key, "delivery"), self._clock.now() + self._backoff(attempts))
        self._rearm()
