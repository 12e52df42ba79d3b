"""Recovery and re-attach (docs/recovery.md).

An awaited run is awaited by an application, not by the parent service: the client that
requested it answers on the run's awaiter subject for as long as it waits. The reconciler
asks each open awaited run's awaiter every `awaiter_check_interval_ms`; a run whose
awaiter is missing at two checks in a row has lost its awaiting side and is recovered in
two passes. A parent replica starting or stopping loses nothing and recovers nothing.

1. inspect each child through the runners (per child `recovery_inspect_timeout_ms`, at
   most `recovery_inspect_concurrency` at once, all of them within
   `recovery_deadline_ms`): a child whose run already ended is recorded as finished,
   never run again; no runner answering ends the run `interrupted` with
   `inspect-timeout`, a failed inspection with `inspect-failed`, and a child not reached
   before the total deadline with `recovery-deadline`. "No record yet" is not a failure:
   the run is watched like a live one.
2. re-attach to each live child: follow its events and progress; every one resets the
   no-progress timeout. When the timeout passes in silence the run ends `interrupted`,
   `no-progress`, `child_still_running: true`, whether or not a runner still holds the
   child: a runner holding a child that sends nothing is not progress. The child is not
   cancelled (a runner that holds it goes on, and its outcome still repairs the run; a
   queued work item is kept for a runner); a repeated request re-attaches to it. A
   finite max window ends it `window-exceeded` and cancels the child, durably
   (`run.cancel_requested` in the log); a watch that cannot follow the child's events
   ends it `not-tailable`.

Each decision is a `run.reattach_decided` event with its reason and timings. Recovering
twice is harmless: decisions are appended with optimistic concurrency and only while the
run is still open. Each append (and each cancel) first passes the lease's gate
(`lease_fresh`, set by the reconciler for its term): a reconciler that cannot show a
fresh lease decides nothing, and a decision is taken from a read of the run made after
the gate, so an append that expects that read's last sequence cannot land once the run
moved (docs/faults.md).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Literal

from tether.adapters.event_log import EventLog
from tether.config import Settings
from tether.domain import decide, recovery_decisions
from tether.domain.events import Event, InterruptedReason
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.leadership import LeadershipLost
from tether.ports import SYSTEM_CLOCK
from tether.reconciler.runners import ChildControl, Inspection, Observability, awaiter_present
from tether.resilience import sleep_unless_stopped
from tether.run_tree import Deliver, cancel_below

RunKey = tuple[str, str, str]
# Awaiter checks in flight at once: a check is one core request, answered at once by the
# server when nobody awaits the run.
AWAITER_CHECKS_IN_FLIGHT = 64
# A silence deadline this process wakes up for this much later was its own pause (SIGSTOP,
# a starved host), not the child's: the child's signals are read for up to LOOK_AGAIN_S
# more before the run is given up.
OWN_PAUSE_S = 0.25
LOOK_AGAIN_S = 1.0



def _key(state: RunState) -> RunKey:
    return (state.parent.agent, state.parent.name, state.run_id)


async def _not_leading() -> None:
    raise LeadershipLost("recovery acts only for a reconciler that leads")


def _failure(task: asyncio.Task) -> BaseException | None:
    """A finished task's error, but the end of a term (its work is being cancelled)."""
    if task.cancelled() or isinstance(task.exception(), LeadershipLost):
        return None
    return task.exception()


async def _nothing_to_deliver(state: RunState | None, appended: list[Event]) -> None:
    del state, appended


class Recovery:
    def __init__(self, settings: Settings, log: EventLog, control: ChildControl,
                 observability: Observability, logger, *, origin: str) -> None:
        self._settings = settings
        self._log = log
        self._control = control
        self._obs = observability
        self._logger = logger
        self._origin = origin
        self._watching: dict[RunKey, asyncio.Task] = {}
        self._recovering: set[RunKey] = set()
        self._passes: set[asyncio.Task] = set()
        # Runs whose awaiter was missing at the last check: recovered if it still is.
        self._missed: set[RunKey] = set()
        # The gate before each decision: the leading reconciler's `Term.fresh`.
        self.lease_fresh: Callable[[], Awaitable[None]] = _not_leading
        # What the end of a descendant cancelled with a spent window owes (the service's
        # `Deliverer.deliver_after`; the reconciler's timer retries what is still owed).
        self.deliver_after: Deliver = _nothing_to_deliver

    async def run(self, stop: asyncio.Event, awaited_open_runs: Callable[[], list[RunState]]) -> None:
        interval_s = self._settings.awaiter_check_interval_ms / 1000
        try:
            while not stop.is_set():
                try:
                    gone = await self.awaiters_gone(awaited_open_runs())
                except Exception as error:  # noqa: BLE001 - checked again at the next interval
                    self._logger.warning("recovery.awaiter_check_failed",
                                         error=f"{type(error).__name__}: {error}")
                    gone = []
                if gone:
                    self._start_pass(gone)
                await sleep_unless_stopped(stop, interval_s)
        finally:
            for task in [*self._passes, *self._watching.values()]:
                task.cancel()
            await asyncio.gather(*self._passes, *self._watching.values(), return_exceptions=True)

    async def awaiters_gone(self, runs: list[RunState]) -> list[RunState]:
        """The runs whose awaiter was missing at this check and the one before."""
        runs = [run for run in runs
                if _key(run) not in self._watching and _key(run) not in self._recovering]
        timeout_s = self._settings.recovery_inspect_timeout_ms / 1000
        slots = asyncio.Semaphore(AWAITER_CHECKS_IN_FLIGHT)

        async def present(run: RunState) -> bool:
            async with slots:
                return await awaiter_present(self._log.nats, self._log.subjects, run, timeout_s)

        answers = await asyncio.gather(*(present(run) for run in runs))
        missed = {_key(run) for run, here in zip(runs, answers, strict=True) if not here}
        gone = [run for run in runs if _key(run) in missed and _key(run) in self._missed]
        self._missed = missed
        return gone

    def _start_pass(self, runs: list[RunState]) -> None:
        keys = {_key(run) for run in runs}
        self._recovering |= keys
        task = asyncio.create_task(self.recover(runs))
        self._passes.add(task)

        def done(finished: asyncio.Task) -> None:
            self._passes.discard(finished)
            self._recovering -= keys
            if (error := _failure(finished)) is not None:
                self._logger.error("recovery.pass_failed", runs=len(runs), exc_info=error)

        task.add_done_callback(done)

    async def recover(self, runs: list[RunState]) -> None:
        runs = [run for run in runs if _key(run) not in self._watching]
        if not runs:
            return
        started = time.monotonic()
        total_s = self._settings.recovery_deadline_ms / 1000
        each_s = self._settings.recovery_inspect_timeout_ms / 1000
        slots = asyncio.Semaphore(self._settings.recovery_inspect_concurrency)
        for run in runs:
            await self._obs.emit("agent_tool:recovery:row", run.run_id, run.parent,
                                 status=run.status, agent_type=run.agent_type)

        async def inspect(run: RunState) -> Inspection:
            async with slots:
                return await self._control.inspect(run, each_s)

        inspections = [asyncio.ensure_future(inspect(run)) for run in runs]
        _, late = await asyncio.wait(inspections, timeout=total_s)
        for run, inspection in zip(runs, inspections, strict=True):
            if inspection in late:
                inspection.cancel()
                await self._interrupt(run, "recovery-deadline", started, inspect_ms=None,
                                      child_still_running=False)
                await self._obs.emit("agent_tool:recovery:deadline", run.run_id, run.parent,
                                     reason="recovery-deadline")
                continue
            await self._decide_after_inspection(run, inspection.result(), started)

    async def _decide_after_inspection(self, run: RunState, inspection: Inspection,
                                       started: float) -> None:
        current = (await self._log.read_run(run.parent, run.run_id)).state
        if current is None:
            return
        if not current.is_open:
            # The child finished meanwhile: its outcome is already in the log.
            await self._record(current, "finished", None, False, started,
                               inspect_ms=inspection.elapsed_ms)
            return
        if inspection.outcome == "silent":
            await self._interrupt(current, "inspect-timeout", started,
                                  inspect_ms=inspection.elapsed_ms, child_still_running=False)
        elif inspection.outcome == "failed":
            self._logger.warning("recovery.inspect_failed", run_id=run.run_id,
                                 error=inspection.error)
            await self._interrupt(current, "inspect-failed", started,
                                  inspect_ms=inspection.elapsed_ms, child_still_running=False)
        else:
            await self._obs.emit("agent_tool:recovery:reattach", run.run_id, run.parent,
                                 found=inspection.outcome == "found")
            self.watch(current, inspect_ms=inspection.elapsed_ms)

    def watch(self, state: RunState, inspect_ms: int | None = None, *,
              announce: bool = True) -> None:
        """Pass 2: follow a live child to its end, or give up on it.

        `announce` appends a `run.reattach_started`; a repeated request already did.
        """
        key = _key(state)
        if key in self._watching:
            return
        task = asyncio.create_task(self._reattach(state, inspect_ms, announce))
        self._watching[key] = task

        def done(finished: asyncio.Task) -> None:
            self._watching.pop(key, None)
            if (error := _failure(finished)) is not None:
                self._logger.error("recovery.watch_failed", run_id=state.run_id,
                                   exc_info=error)

        task.add_done_callback(done)

    async def _reattach(self, state: RunState, inspect_ms: int | None, announce: bool) -> None:
        started = time.monotonic()
        current: RunState | None = state
        try:
            await self.lease_fresh()  # the re-attach is decided from the read below
            history = await self._log.read_run(state.parent, state.run_id)
            current = history.state
            if current is None or current.is_hard_terminal:
                return
            if announce:
                cause = decide.timer_cause(SYSTEM_CLOCK.now(), self._origin)
                current, _ = await self._log.recent.update(
                    state.parent, state.run_id,
                    partial(recovery_decisions.reattach_started, cause=cause, why="recovery"))
                history = await self._log.read_run(state.parent, state.run_id)
                current = history.state
                if current is None or current.is_hard_terminal:
                    return
            await self._follow(current, history.last_seq, started, inspect_ms)
        except (asyncio.CancelledError, LeadershipLost):
            raise
        except Exception as error:  # noqa: BLE001 - whatever stopped the watch is a decision
            # A lost connection, a consumer the server refused, an unreadable stream: the
            # child's events cannot be followed, which the run's awaiter is told.
            self._logger.warning("recovery.not_tailable", run_id=state.run_id,
                                 error=f"{type(error).__name__}: {error}")
            if current is not None:
                await self._interrupt(current, "not-tailable", started, inspect_ms=inspect_ms,
                                      child_still_running=True)

    async def _follow(self, current: RunState, last_seq: int, started: float,
                      inspect_ms: int | None) -> None:
        silence_s = self._settings.reattach_no_progress_timeout_ms / 1000
        window_ms = self._settings.reattach_max_window_ms
        window_ends = None if window_ms is None else started + window_ms / 1000
        signals: asyncio.Queue[None] = asyncio.Queue()
        parent, run_id = current.parent, current.run_id

        async def on_progress(_msg) -> None:
            signals.put_nowait(None)

        progress = await self._log.nats.subscribe(
            self._log.subjects.run_progress(parent, run_id), cb=on_progress)
        events = self._log.follow(self._log.subjects.run_events(parent, run_id),
                                  start_seq=last_seq + 1)
        last_signal = time.monotonic()
        window_spent = False
        looked_again = False  # after a deadline this process woke up late for
        try:
            async with aclosing(events) as stream:
                next_event = asyncio.ensure_future(anext(stream))
                try:
                    while True:
                        give_up_at = last_signal + silence_s
                        # Which deadline the wait is for decides the reason, not a clock read
                        # after it: uvloop's timers run on a cached millisecond clock and may
                        # wake a little before time.monotonic() reaches the deadline.
                        if window_ends is not None and window_ends <= give_up_at:
                            give_up_at, window_spent = window_ends, True
                        next_signal = asyncio.ensure_future(signals.get())
                        done, _ = await asyncio.wait(
                            {next_event, next_signal},
                            timeout=max(give_up_at - time.monotonic(), 0),
                            return_when=asyncio.FIRST_COMPLETED)
                        next_signal.cancel()
                        if next_event in done:
                            stored = next_event.result()
                            evolved = (evolve(current, stored.event, stored.logged_at).state
                                       if stored.event else current)
                            if evolved is None:
                                return  # cleared while we watched
                            current = evolved
                            if current.is_hard_terminal:
                                await self._record(current, "finished", None, False, started,
                                                   inspect_ms=inspect_ms)
                                return
                            if stored.event and stored.event.type == "run.interrupted":
                                return  # someone else gave up on it (a budget): not ours
                            last_signal = time.monotonic()
                            next_event = asyncio.ensure_future(anext(stream))
                        elif next_signal in done:
                            last_signal = time.monotonic()
                        elif (not window_spent and not looked_again
                              and time.monotonic() - give_up_at > OWN_PAUSE_S):
                            # Woken well past the deadline: this process was stopped or
                            # starved, and what the child sent meanwhile waits in its
                            # buffers, behind the timer that fired first. Look again for
                            # a moment before taking its own pause for the child's silence.
                            looked_again = True
                            last_signal = time.monotonic() - silence_s + min(silence_s,
                                                                             LOOK_AGAIN_S)
                        else:
                            # Silent for the whole timeout (a runner that answers for the
                            # child is no signal from it), or the window is spent.
                            break
                        if next_event in done or next_signal in done:
                            looked_again = False
                finally:
                    next_event.cancel()
                    # Let the cancelled read finish before the stream is closed.
                    await asyncio.gather(next_event, return_exceptions=True)
            if window_spent:
                # The child had its whole window: it is cancelled and considered spent.
                await self.lease_fresh()
                stopped = await self._control.cancel(current, decide.GIVE_UP,
                                                     self._settings.cancel_grace_ms / 1000)
                await self._interrupt(current, "window-exceeded", started,
                                      inspect_ms=inspect_ms, child_still_running=not stopped,
                                      cancel=True)
            else:
                # Soft: the child is not cancelled. A runner that holds it goes on (its
                # outcome repairs the run), a queued item is kept for a runner, and a
                # repeated request re-attaches to it.
                await self._interrupt(current, "no-progress", started, inspect_ms=inspect_ms,
                                      child_still_running=True,
                                      silent_ms=int((time.monotonic() - last_signal) * 1000))
        finally:
            await progress.unsubscribe()

    async def _interrupt(self, state: RunState, reason: InterruptedReason, started: float, *,
                         inspect_ms: int | None, child_still_running: bool,
                         silent_ms: int | None = None, cancel: bool = False) -> None:
        await self._record(state, "interrupted", reason, child_still_running, started,
                           inspect_ms=inspect_ms, silent_ms=silent_ms, cancel=cancel)

    async def _record(self, state: RunState,
                      outcome: Literal["finished", "reattached", "interrupted"],
                      reason: InterruptedReason | None,
                      child_still_running: bool, started: float, *, cancel: bool = False,
                      **timings: int | None) -> None:
        timings_ms = {k: v for k, v in timings.items() if v is not None}
        timings_ms["waited_ms"] = int((time.monotonic() - started) * 1000)
        await self.lease_fresh()
        # Decided from a read made after the gate (a plain `update`), not from what this
        # process knew of the run before it.
        cause = decide.timer_cause(SYSTEM_CLOCK.now(), self._origin)
        _, appended = await self._log.update(
            state.parent, state.run_id,
            partial(recovery_decisions.reattach_decided, cause=cause, outcome=outcome,
                    reason=reason, child_still_running=child_still_running,
                    timings=timings_ms, cancel=cancel))
        if appended:
            self._logger.info("recovery.decided", run_id=state.run_id, outcome=outcome,
                              reason=reason, child_still_running=child_still_running,
                              **timings_ms)
        if cancel and appended:
            # A spent window stops the whole tree: what the child delegated, deepest first.
            await cancel_below(self._log, state, cause, f"its parent run gave up: {reason}",
                               signal=self._signal_descendant, deliver=self.deliver_after)

    async def _signal_descendant(self, state: RunState) -> None:
        await self._control.signal_cancel(state, "cancelled")
