"""One work item, from its delivery to its acknowledgement.

The work item names the run; the run's events are the truth. (A new run's first item
also carries its `run.requested`, so the runner need not read it: the append of
`run.running` expects that event's sequence, and a run that moved since is read.) Every
step is safe to repeat, because a work item is redelivered whenever its runner dies or
gives it back:

- `run.running` is appended with optimistic concurrency and the next attempt number, so
  of two runners holding the same run only one goes on; a redelivered item takes the run
  over, a second item for one dispatch (`WorkItem.attempt`) does not;
- the outcome is appended only while the run is not hard-terminal (never a second
  `run.completed`), with a deterministic event id so a retried append is stored once;
- the work item is acknowledged only after the outcome is in the log: a runner that
  dies before that leaves the item to be redelivered and the run to be resumed;
- a child that pauses (returns `AwaitingInput`) ends the attempt with `run.paused` and a
  milestone instead of an outcome; the item is acknowledged, and the parent's
  `run.resumed` dispatches a new one.
"""

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Any, Literal, TypeVar

from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from tether.adapters.holds import Hold
from tether.agent_registry import agent_version
from tether.child.agent import AwaitingInput, ChildAgent
from tether.child.context import RunCancelled, RunContext, RunSuperseded, bind_context
from tether.child.held_item import HeldItem
from tether.child.message_handing import MessageHanding
from tether.child.recorder import RunRecorder
from tether.child.work import (
    MAX_ERROR_CHARS,
    ChildResult,
    Outcome,
    OutcomeKind,
    RunnerEnvironment,
    child_result,
    execution_token,
    explain_validation,
    safe_error,
)
from tether.contract.messages import WorkItem
from tether.domain import attempts, decide
from tether.domain.decide import GIVE_UP, attempts_since_resume
from tether.domain.events import (
    Event,
    RunAborted,
    RunAbortedData,
    RunCompleted,
    RunCompletedData,
    RunFailed,
    RunFailedData,
    RunPaused,
    RunPausedData,
    RunRunning,
    RunRunningData,
)
from tether.domain.fold import evolve
from tether.domain.ids import derived_event_id
from tether.domain.run_state import RunState
from tether.domain.versions import on_other_version
from tether.log import get_logger
from tether.loop_watch import child_task_name
from tether.ports import SYSTEM_CLOCK, EventTooLarge, RunHistory

E = TypeVar("E", bound=Event)


class Execution:
    def __init__(self, env: RunnerEnvironment, agent_cls: type[ChildAgent], msg: Msg,
                 item: WorkItem, hold: Hold | None = None) -> None:
        self._env, self._agent_cls, self.item = env, agent_cls, item
        self.run_id, self.parent = item.run_id, item.parent
        self.attempt = 0
        ack_wait_s = env.settings.work_ack_wait_ms / 1000
        self._item = HeldItem(msg, hold or Hold(time.monotonic(), ack_wait_s), env.log,
                              item.parent, item.run_id, renew_every_s=ack_wait_s / 3)
        self._owner = execution_token()  # names this execution's events
        self._incarnation = ""  # the life of the run id this item works on, once read
        self._started = time.monotonic()
        self._ctx: RunContext | None = None
        self._recorder: RunRecorder | None = None
        self._child: asyncio.Task[ChildResult] | None = None
        self._hard_cancel: asyncio.TimerHandle | None = None
        self._beating: asyncio.Task[None] | None = None  # the heartbeat, once its first is due
        self._causation_id = f"work:{item.run_id}:{item.dispatch}"
        # Why the child is being stopped: a cancel (recorded as aborted), the run ended or
        # vanished elsewhere (nothing to record), a newer attempt took over, a shutdown.
        self._stop_reason: attempts.StopReason | None = None
        self._cancel_detail: str | None = None
        self._messages = MessageHanding(env.log, item.parent, item.run_id)
        self.finished = asyncio.Event()

    def holds(self, msg: Msg) -> bool:
        """Whether `msg` is another delivery of this execution's own work item."""
        return not self.finished.is_set() and self._item.same_item(msg)

    def adopt(self, msg: Msg, hold: Hold) -> None:
        """The server delivered this execution's item again (`HeldItem.adopt`)."""
        self._item.adopt(msg, hold)

    # --- stopping the child, from the runner --------------------------------------------

    def cancel(self, detail: str | None = None) -> None:
        """Cooperative first (`ctx.cancelled`), then the child's task after a short grace.

        A give-up (the reconciler ended the run `interrupted` on a budget) stops the child
        and records nothing: the interruption is the run's outcome, and an abort here
        would only hide it.
        """
        self._stop("give-up" if detail == GIVE_UP else "cancel", detail)

    def look_for_messages(self, state: RunState | None = None) -> None:
        """The run has a steering message for its child: hand over what the child has not
        had (`MessageHanding.look`), once its context exists."""
        if not self.finished.is_set():
            self._messages.look(state)

    @property
    def child_status(self) -> str:
        if self._child is None:
            return "queued"
        if self._child.done():
            return "stopped"
        if self._ctx is not None and self._ctx.child_status is not None:
            return self._ctx.child_status
        return "running"

    def release_for_shutdown(self) -> None:
        """The process is stopping: stop the child now and give the item back."""
        if self._stop_reason is None:
            self._stop_reason = "shutdown"
        self._item.release()
        if self._child is not None:
            self._child.cancel()

    def _stop(self, reason: Literal["cancel", "give-up", "gone", "superseded"],
              detail: str | None) -> None:
        if self._stop_reason is not None:
            return
        self._stop_reason, self._cancel_detail = reason, detail
        if self._ctx is not None:
            self._ctx.cancelled.set()
        if self._child is not None and self._hard_cancel is None:
            self._hard_cancel = asyncio.get_running_loop().call_later(
                self._env.cancel_grace_s, self._child.cancel)

    # --- the lifecycle -----------------------------------------------------------------

    async def run(self) -> Outcome:
        try:
            return await self._run()
        finally:
            self.finished.set()

    async def _run(self) -> Outcome:
        log = self._env.log
        first_delivery = self._item.first_delivery
        history = ((self._history_from_item() if first_delivery else None)
                   or await log.read_run(self.parent, self.run_id))
        state = history.state
        if state is not None:
            self.attempt, self._incarnation = state.attempt, state.incarnation
        if (not_started := await self._not_to_start(state)) is not None:
            return not_started
        assert state is not None
        if first_delivery and self.item.attempt is not None and state.attempt > self.item.attempt:
            # A redelivery takes the run over (its runner is gone); a first delivery of an
            # item published before the run's current attempt began is a second item for
            # one dispatch, and the run is another runner's.
            return await self._ack("skipped", "another work item already started the run")
        if state.paused is not None:
            # A stale item for a run that waits for input; a predecessor that paused it and
            # died before adding the milestone leaves that to us.
            await self._new_recorder(state).pause_milestone(state.paused)
            return await self._ack("skipped", f"the run is {state.paused.reason}")
        version = agent_version(self._agent_cls)
        if (refused := await self._refused(state, history, version)) is not None:
            return refused

        if not self._item.hold.fresh:
            # Stopped (paused) past the item's ack wait before its child started: the
            # server may have handed the item to another runner, which may be about to
            # take the run. Start nothing; the item comes back if nobody took it.
            return self._outcome("superseded", self._item.lapsed("before its child started"))
        expected, incarnation = state.attempt, state.incarnation
        running = self._event(RunRunning, RunRunningData(
            attempt=expected + 1, runner_id=self._env.runner_id, agent_version=version),
            "running", expected + 1, self._owner)

        state, appended = await self._item.update(partial(
            decide.start_attempt, running=running, expected_attempt=expected,
            incarnation=incarnation))
        if state is not None:
            self._incarnation = state.incarnation
        if not appended:
            # Decided from a fresh read: the run moved since we looked.
            if ((state is None or state.attempt == expected)
                    and (not_started := await self._not_to_start(state)) is not None):
                return not_started
            return await self._ack("skipped", "another runner took the run")
        assert state is not None
        self.attempt = expected + 1
        self._causation_id = running.event_id

        try:
            payload = self._agent_cls.input_model.model_validate(state.input)
        except ValidationError as error:
            return await self._fail(f"invalid input for {self.item.agent_type}: "
                                    f"{explain_validation(error)}"[:MAX_ERROR_CHARS])
        if state.milestones:  # a predecessor's milestones: their notifications may be owed
            await self._deliver(state, owed=True)
        return await self._run_child(state, payload)

    async def _refused(self, state: RunState, history: RunHistory, version: str
                       ) -> Outcome | None:
        """A run not to be started again (`attempts.not_resumed`) fails here, saying why;
        one begun under another version of its agent's code that may resume is resumed
        with a warning. None: it starts."""
        settings = self._env.settings
        change = on_other_version(state.agent_version, version, settings.resume_other_versions)
        made = attempts_since_resume(history.events)
        if (error := attempts.not_resumed(state, made, settings.max_attempts, version,
                                          change)) is not None:
            return await self._fail(error)
        if change == "resume":
            get_logger(run_id=self.run_id).warning(
                "run.version_changed", agent_type=state.agent_type,
                recorded=state.agent_version, running=version, attempt=state.attempt + 1)
        return None

    def _history_from_item(self) -> RunHistory | None:
        """A new run's first item carries its request: the run as it was then, without a
        read. Appending `run.running` expects the request's sequence, so a run that has
        moved since is read and decided again."""
        requested, seq = self.item.requested, self.item.requested_seq
        if (requested is None or seq is None or requested.run_id != self.run_id
                or requested.parent != self.parent):
            return None
        state = evolve(None, requested).state
        self._env.log.recent.remember_run(self.parent, self.run_id, state, seq)
        return RunHistory((requested,), seq, state)

    async def _not_to_start(self, state: RunState | None) -> Outcome | None:
        """The outcome of an item whose run is not to be started (None: it is)."""
        verdict = attempts.not_to_start(state, self.item.agent_type)
        return None if verdict is None else await self._carry_out(verdict, state)

    async def _run_child(self, state: RunState, payload: BaseModel) -> Outcome:
        env = self._env
        recorder = self._recorder = self._new_recorder(state)
        ctx = self._ctx = RunContext(
            run_id=self.run_id, parent=self.parent, agent_type=state.agent_type,
            attempt=self.attempt, recorder=recorder, history=state,
            client_factory=env.parent_client, stop_reason=lambda: self._stop_reason)
        self._messages.start(ctx, self._incarnation)
        # Stopped while we prepared: do not start a child only to stop it.
        if (verdict := attempts.stopped_before_start(self._stop_reason,
                                                     self._cancel_detail)) is not None:
            return await self._carry_out(verdict)
        if not self._item.hold.fresh:  # stopped since `run.running`: is the attempt still ours?
            current, standing, _ = await self._item.confirm_persistently(self.attempt,
                                                                         self._incarnation)
            if standing == "ended":
                await self._deliver(current)  # what the end owes: its writer may have died
            if standing != "current":
                return await self._not_recorded(current, "the child was about to start")
        # (Nothing awaited between the check and the start.)
        self._child = asyncio.create_task(self._invoke(ctx, payload, recorder),
                                          name=child_task_name(state.agent_type, self.run_id))
        # The first beat is due after an interval, and most runs end before it: a timer
        # starts the beating, instead of a task per run that would sleep until then.
        interval = self._env.settings.work_ack_wait_ms / 1000 / 3
        first_beat = asyncio.get_running_loop().call_later(interval, self._start_heartbeat,
                                                           interval)
        try:
            await asyncio.wait({self._child})
        finally:
            first_beat.cancel()
            if self._beating is not None:
                self._beating.cancel()
            self._messages.stop()
            if self._hard_cancel is not None:
                self._hard_cancel.cancel()
            if not self._child.done():  # this handler itself was cancelled
                self._child.cancel()
            with suppress(RunSuperseded):  # (the gate stopped the attempt: `_stop_reason`)
                await recorder.flush(persist=True)
        return await self._settle(self._child)

    def _new_recorder(self, state: RunState) -> RunRecorder:
        return RunRecorder(self._env.log, state, attempt=self.attempt,
                           coalesce_ms=self._env.settings.progress_coalesce_ms,
                           persist_ms=self._env.settings.progress_persist_ms,
                           causation_id=self._causation_id, deliverer=self._env.deliverer,
                           hold=self._item.hold, confirm=self._ensure_current)

    async def _invoke(self, ctx: RunContext, payload: BaseModel, recorder: RunRecorder) -> ChildResult:
        bind_context(ctx)
        # First step, which a pause can delay: start only on a sure hold or a current attempt.
        ctx.started_at = SYSTEM_CLOCK.now()
        await self._ensure_current()
        if ctx.history is not None and ctx.history.waiting_messages:
            await ctx.offer(ctx.history.waiting_messages)  # sent before this attempt began
        agent = self._agent_cls()
        returned = await agent.run(ctx, payload)
        if self._stop_reason != "give-up":
            # A cooperative child that stopped early was cancelled. After a give-up, what
            # the child returns is its result: a late completion repairs the interruption.
            ctx.raise_if_cancelled()
        return await child_result(agent, self.run_id, returned, recorder)

    async def _settle(self, child: asyncio.Task[ChildResult]) -> Outcome:
        error = None if child.cancelled() else child.exception()
        if isinstance(error, RunSuperseded) and self._stop_reason is None:
            # The child found out before the heartbeat did.
            self._stop_reason, self._cancel_detail = error.reason, str(error)  # type: ignore[assignment]
        if child.cancelled() or isinstance(error, RunCancelled):
            if (stopped := await self._settle_stopped(error)) is not None:
                return stopped
            error = asyncio.CancelledError("the child's task was cancelled by the child itself")
        if error is not None:
            return await self._fail(safe_error(error), error)
        result = child.result()
        if result.pause is not None:
            return await self._pause(result.pause)
        completed = self._event(RunCompleted, RunCompletedData(
            summary=result.summary, output=result.output), "completed", self._owner)
        try:
            state, ended = await self._end(completed)
        except EventTooLarge as too_large:
            return await self._fail(f"the child's result is {too_large.size} bytes; the "
                                    f"largest event NATS accepts is {too_large.limit} bytes")
        if not ended:
            return await self._not_recorded(state, "the child finished")
        return await self._ack("completed")

    async def _settle_stopped(self, error: BaseException | None) -> Outcome | None:
        """The outcome of a child that stopped on a cancel (`attempts.stopped`)."""
        verdict = attempts.stopped(self._stop_reason, self._cancel_detail, error)
        return None if verdict is None else await self._carry_out(verdict)

    async def _carry_out(self, verdict: attempts.Verdict,
                         state: RunState | None = None) -> Outcome:
        if verdict.deliver_first:
            await self._deliver(state)
        if verdict.action == "skip":
            return await self._ack("skipped", verdict.detail)
        if verdict.action == "abort":
            return await self._abort(verdict.detail, cause=verdict.cause)
        if verdict.action == "release":
            await self._item.nak()
            return self._outcome("released", verdict.detail)
        return self._outcome("superseded", verdict.detail)

    def _start_heartbeat(self, interval: float) -> None:
        self._beating = asyncio.ensure_future(self._item.heartbeat(
            interval, self.attempt, self._incarnation, self._looked))

    def _looked(self, state: RunState | None) -> None:
        """What a heartbeat saw of the run: an attempt no longer current stops its child,
        and so does a cancel the signal did not bring."""
        standing = attempts.standing(state, self.attempt, self._incarnation)
        if standing != "current":
            self._moved_on(state, standing)
        elif state is not None and state.cancel_requested_at is not None:
            self.cancel(state.cancel_reason)
        elif state is not None and self._ctx is not None and any(
                m.message_id not in self._ctx.offered for m in state.waiting_messages):
            self.look_for_messages(state)  # its signal did not come

    # --- the hold on the item, and the attempt's standing --------------------------------

    async def _ensure_current(self) -> None:
        """Before the child reports anything: a stale hold (the runner was stopped past
        it) is confirmed against the log first, and an attempt that is no longer the
        run's current one stops its child (`RunSuperseded`) instead of reporting."""
        if self._item.hold.fresh:
            return
        state, standing, _ = await self._item.confirm_persistently(self.attempt,
                                                                   self._incarnation)
        if standing != "current":
            raise self._moved_on(state, standing)

    def _moved_on(self, state: RunState | None, standing: attempts.Standing) -> RunSuperseded:
        """Stop the child of an attempt that is no longer the run's current one; the
        error its child gets for a report it may no longer make."""
        detail = attempts.standing_detail(state, standing)
        reason: Literal["superseded", "gone"] = (
            "superseded" if standing == "superseded" else "gone")
        self._stop(reason, detail)
        return RunSuperseded(detail, reason=reason)

    # --- outcomes ----------------------------------------------------------------------

    async def _pause(self, pause: AwaitingInput) -> Outcome:
        """The child waits for input: record the pause and its milestone, end the attempt.

        The pause's event id derives from the child's key, so a successor that resumes
        after a crash and pauses at the same point appends nothing new.
        """
        paused = self._event(RunPaused, RunPausedData(reason=pause.reason, pending=pause.pending),
                             "paused", pause.key)

        state, _ = await self._item.update(partial(
            decide.pause_attempt, paused=paused, attempt=self.attempt,
            incarnation=self._incarnation))
        verdict = attempts.not_paused(state, self.attempt, self._incarnation)
        if verdict is not None:
            return await self._carry_out(verdict)
        assert self._recorder is not None and state is not None and state.paused is not None
        await self._recorder.pause_milestone(state.paused)
        return await self._ack("paused", f"{state.paused.reason}: "
                                         f"{len(state.paused.pending)} pending")

    async def _abort(self, reason: str | None,
                     cause: Literal["cancel", "child"] = "cancel") -> Outcome:
        error = "cancelled" if reason in (None, "", "cancelled") else f"cancelled: {reason}"
        aborted = self._event(RunAborted, RunAbortedData(error=error, cause=cause),
                              "aborted", self._owner)
        state, ended = await self._end(aborted)
        if not ended:
            return await self._not_recorded(state, f"the run was to end aborted ({error})")
        return await self._ack("aborted", error)

    async def _fail(self, error: str, exception: BaseException | None = None) -> Outcome:
        failed = self._event(RunFailed, RunFailedData(error=error), "failed", self._owner)
        state, ended = await self._end(failed)
        if not ended:
            return await self._not_recorded(state, f"the run was to end failed ({error})")
        await self._item.ack()
        return self._outcome("failed", error, exception)

    def _event(self, cls: Callable[..., E], data: Any, *key: object) -> E:
        """An event of this attempt, its id from the run's life and `key` (what, and whose)."""
        return cls(event_id=derived_event_id(self.run_id, self._incarnation, *key),
                   run_id=self.run_id, parent=self.parent, occurred_at=SYSTEM_CLOCK.now(),
                   correlation_id=self.run_id, causation_id=self._causation_id, data=data)

    async def _end(self, outcome: Event) -> tuple[RunState | None, bool]:
        """Append the run's outcome, while this attempt is the run's current one, and
        deliver its hooks; False when it was not appended. A run that had ended already
        gets what that end still owes (its writer may have died first); a run a newer
        attempt took over is left to that attempt."""
        state, appended = await self._item.update(partial(
            decide.finish_attempt, outcome=outcome, attempt=self.attempt,
            incarnation=self._incarnation))
        if appended or attempts.standing(state, self.attempt, self._incarnation) == "ended":
            await self._deliver(state, appended)
        return state, bool(appended)

    async def _not_recorded(self, state: RunState | None, what: str) -> Outcome:
        """The outcome of an attempt that found its run moved on: nothing was recorded.
        A newer attempt owns the run and its work item, so the item is left alone; an
        ended or cleared run's item is acknowledged."""
        standing = attempts.standing(state, self.attempt, self._incarnation)
        if standing == "current":  # (the decision refuses a current attempt nothing else)
            raise AssertionError(f"an outcome of the current attempt was refused: {what}")
        detail = f"{what}; {attempts.standing_detail(state, standing)}: nothing recorded"
        if standing == "superseded":
            return self._outcome("superseded", detail)
        return await self._ack("skipped", detail)

    async def _deliver(self, state: RunState | None, appended: Sequence[Event] = (), *,
                       owed: bool = False) -> None:
        """The hooks of the outcome just appended, or what the ended run still owes
        (`Deliverer.deliver_after`; with `owed`, what its milestones owe too), for a run of
        this life; retried across a broker restart, before the item is acknowledged."""
        deliverer = self._env.deliverer
        if (deliverer is not None and state is not None and state.detached is not None
                and state.incarnation == self._incarnation):
            async for attempt in self._item.persisting("run.deliver"):
                with attempt:
                    await (deliverer.deliver_owed(state) if owed
                           else deliverer.deliver_after(state, appended))

    async def _ack(self, kind: OutcomeKind, detail: str | None = None) -> Outcome:
        await self._item.ack()
        return self._outcome(kind, detail)

    def _outcome(self, kind: OutcomeKind, detail: str | None = None,
                 exception: BaseException | None = None) -> Outcome:
        return Outcome(run_id=self.run_id, parent=self.parent, agent_type=self.item.agent_type,
                       kind=kind, attempt=self.attempt, detail=detail,
                       duration_ms=int((time.monotonic() - self._started) * 1000),
                       exception=exception)
