"""Records what a child reports during one attempt: milestones, output, progress.

A resumed run (a redelivered work item) re-runs the child from the start, so the
recorder begins from what the run already holds and recognises the replay:

- the n-th milestone named X in this attempt is the n-th one recorded under that name,
  so it is skipped while the log already has it (with unique names: a recorded name is
  skipped), and new ones continue the sequence;
- output text that matches the recorded output from the start is skipped chunk by chunk,
  and new text continues the indexes.

Milestones and outputs carry deterministic event ids (`<run>:ms:<seq>`, `<run>:out:<i>`),
so an append retried after a lost acknowledgement is stored once. Each report is
appended only while its attempt is the run's current one (`decide.record_report`), and
only after the runner's `gate` has checked that it still holds the work item: an attempt
whose runner was stopped (paused) while another runner took the run over reports
nothing after it wakes; it is stopped instead (`RunSuperseded`).
"""

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import suppress
from functools import partial
from typing import TYPE_CHECKING, Any

from tether.child.agent import PAUSE_MILESTONES
from tether.child.context import RunSuperseded
from tether.contract.messages import progress_signal_json
from tether.domain import decide
from tether.domain.events import (
    Event,
    RunMilestone,
    RunMilestoneData,
    RunOutput,
    RunOutputData,
    RunProgressPersisted,
    RunProgressPersistedData,
    RunStepRecorded,
    RunStepRecordedData,
)
from tether.domain.run_state import PauseInfo, ProgressSnapshot, RunState
from tether.log import get_logger
from tether.ports import SYSTEM_CLOCK, EventLog
from tether.resilience import Persisting

if TYPE_CHECKING:
    from tether.adapters.holds import Hold
    from tether.delivery.deliverer import Deliverer


# A signal whose `data` is live only: kept on the progress stream just long enough to be
# republished and handed to the followers already there (`Nats-TTL`, nats-server 2.11+).
LIVE_ONLY_HEADERS = {"Nats-TTL": "1s"}



class RunRecorder:
    def __init__(self, log: EventLog, state: RunState, *, attempt: int, coalesce_ms: int,
                 persist_ms: int = 0, causation_id: str | None = None,
                 deliverer: "Deliverer | None" = None,
                 hold: "Hold | None" = None,
                 confirm: Callable[[], Awaitable[None]] | None = None) -> None:
        """`deliverer`: puts out the chat notification of a milestone the run asked for.
        `hold` and `confirm`, the gate before each report: while the runner's hold on the
        work item is stale, `confirm` is awaited first, and raises `RunSuperseded` when
        the attempt may no longer report."""
        self._log = log
        self._hold, self._confirm = hold, confirm
        self._deliverer = deliverer
        self.run_id, self.parent = state.run_id, state.parent
        self._incarnation, self._event_id = state.incarnation, state.event_id  # this life's
        self._attempt = attempt
        self._window_s = coalesce_ms / 1000
        if state.detached is not None and state.no_progress_budget_ms > 0:
            # The reconciler judges silence by the snapshots: one lands well within it.
            persist_ms = min(persist_ms, state.no_progress_budget_ms // 4)
        self._persist_window_s = persist_ms / 1000
        self._causation_id = causation_id
        self._agent_type = state.agent_type
        self._progress_subject = log.subjects.run_progress(state.parent, state.run_id)

        self._recorded_names = Counter(m.name for m in state.milestones)
        self._names_this_attempt: Counter[str] = Counter()
        self._next_sequence = max((m.sequence for m in state.milestones), default=-1) + 1
        self.milestones_recorded = 0
        self.reported_milestones: list[str] = []  # this attempt's, recorded or replayed

        self._recorded_text = state.output_text
        self._replayed_chars = 0  # how much of the recorded text this attempt has re-emitted
        self._next_index = max(state.output_parts, default=-1) + 1
        self._new_text: list[str] = []

        # Progress snapshots are "latest `at` wins" in the fold, so every snapshot this
        # recorder writes gets a strictly later `at` than the one before, even within 1 ms.
        self._last_at = state.progress.at if state.progress else 0
        self._progress_count = 0
        # A reported value waiting for its window, and whether its data is to persist.
        self._pending: ProgressSnapshot | None = None
        self._pending_persist = False
        # Timers are loop callbacks, not tasks: most are cancelled by a flush before they
        # fire (a milestone, the final signal), and a task costs several loop turns.
        self._timer: asyncio.TimerHandle | None = None
        self._last_send = -float("inf")
        self._unpersisted: ProgressSnapshot | None = None  # sent, not yet in the log
        self._persist_timer: asyncio.TimerHandle | None = None
        self._fired: set[asyncio.Task[None]] = set()  # sends a timer started, until done
        # The attempt's `run.running`, just appended, is its first sign of life in the
        # log: a snapshot reported in the first window waits for the window's end (or the
        # outcome), and a short run writes only its last one.
        self._last_persist = time.monotonic()
        self._send_lock = asyncio.Lock()  # one signal at a time, in the order reported
        self._milestone_lock = asyncio.Lock()
        self._output_lock = asyncio.Lock()
        self._warned_send_failure = False

    @property
    def output_text(self) -> str:
        """The run's whole output text: what was recorded before plus this attempt's."""
        return self._recorded_text + "".join(self._new_text)

    async def _append(self, event: Event) -> RunState | None:
        """Append unless the run id is in another life: cleared, perhaps requested again,
        while this child ran (its milestones would then be the new run's). The fold keys
        each of these events (sequence, index, time), so a repeat changes nothing.
        Returns the run after it."""
        state, _ = await self._update(partial(
            decide.record_report, event=event, attempt=self._attempt,
            incarnation=self._incarnation))
        return state

    async def _update(self, decision: Callable[[RunState | None], Sequence[Event]]
                      ) -> tuple[RunState | None, list[Event]]:
        """The log's `update`, retried across a broker restart: a child's report is not
        lost, and does not fail the child, because the broker was away for a moment.
        (The child's own task: a stop cancels it, and the retry with it.)"""
        async for attempt in Persisting("child.report", self._logger):
            with attempt:
                await self.ensure_current()
                updated = await self._log.recent.update(self.parent, self.run_id, decision)
        return updated

    async def ensure_current(self) -> None:
        """The gate before each report: while the runner's hold is stale, the attempt is
        confirmed first (`RunSuperseded` when it may no longer report)."""
        if self._hold is not None and not self._hold.fresh and self._confirm is not None:
            await self._confirm()


    def _logger(self):
        """Bound only when there is something to say: most runs log nothing."""
        return get_logger(run_id=self.run_id, agent_type=self._agent_type)

    # --- milestones -------------------------------------------------------------------

    async def milestone(self, name: str, *, fraction: float | None, message: str | None,
                        phase: str | None, data: Any) -> bool:
        """Record a milestone; False when it is a replay of one already recorded."""
        async with self._milestone_lock:
            self._names_this_attempt[name] += 1
            self.reported_milestones.append(name)
            if self._names_this_attempt[name] <= self._recorded_names[name]:
                return False
            # The milestone is the run's latest progress: an ephemeral value still waiting
            # for its window is superseded (as by the end), and one being sent lands
            # before it (the send lock, taken below).
            self._drop_pending()
            sequence = self._next_sequence
            async with self._send_lock:
                at = self._next_at()
                state = await self._append(RunMilestone(
                    event_id=self._event_id("ms", sequence), run_id=self.run_id,
                    parent=self.parent, occurred_at=at, correlation_id=self.run_id,
                    causation_id=self._causation_id,
                    data=RunMilestoneData(sequence=sequence, name=name, data=data,
                                          fraction=fraction, message=message, phase=phase)))
                self._next_sequence += 1
                self.milestones_recorded += 1
                self._snapshot_recorded()
                # Live subscribers see the milestone on the progress subject too, marked
                # by `milestone`, so a progress bar and an onProgress hook need one feed.
                await self._publish_signal(ProgressSnapshot(
                    fraction=fraction, message=message, phase=phase, milestone=name,
                    data=data, at=at), persist=True)
            await self._notify(state, name)
            return True

    async def _notify(self, state: RunState | None, name: str) -> None:
        """The chat message of a milestone the run asked for one of (`on_milestones`),
        right after it was recorded. (A runner that dies first leaves it to the run's
        next attempt, which delivers what the ledger lacks before it starts the child.)"""
        deliverer = self._deliverer
        if (deliverer is None or state is None or state.incarnation != self._incarnation
                or not deliverer.owes_notification(state, name)):
            return
        milestone = next(m for m in state.milestones if m.name == name)
        async for attempt in Persisting("child.notify", self._logger):
            with attempt:
                await deliverer.notify_milestone(state, milestone)

    def replay_milestones(self, names: "list[str] | tuple[str, ...]") -> None:
        """Count milestones a resumed child will not report again (their steps were
        recorded and are skipped), so that its next one of the same name is new."""
        for name in names:
            self._names_this_attempt[name] += 1

    async def pause_milestone(self, pause: PauseInfo) -> bool:
        """The milestone that tells the parent a run waits for input, recorded once per pause.

        Keyed by the pause id in its data, so a runner that finds a paused run whose
        milestone is missing (its predecessor died in between) adds it, and only then.
        """
        name = PAUSE_MILESTONES[pause.reason]
        what = "approval of" if pause.reason == "waiting_for_human" else "the output of"
        message = f"waiting for {what} {len(pause.pending)} tool call(s)"
        data = {"pause_id": pause.pause_id, "reason": pause.reason, "pending": pause.pending}

        def milestone_if_owed(state: RunState | None) -> list[Event]:
            sequence = decide.pause_milestone_sequence(state, pause.pause_id, name)
            if sequence is None:
                return []
            return [RunMilestone(
                event_id=self._event_id("ms", sequence), run_id=self.run_id,
                parent=self.parent, occurred_at=self._next_at(), correlation_id=self.run_id,
                causation_id=self._causation_id,
                data=RunMilestoneData(sequence=sequence, name=name, data=data, message=message,
                                      phase=pause.reason))]

        state, appended = await self._update(milestone_if_owed)
        if appended:
            await self._publish_signal(ProgressSnapshot(
                message=message, phase=pause.reason, milestone=name, data=data,
                at=appended[0].occurred_at), persist=True)
            await self._notify(state, name)
        return bool(appended)

    # --- steps --------------------------------------------------------------------------

    async def step(self, index: int, step: dict[str, Any]) -> None:
        """Append `run.step_recorded` while this attempt holds the run.

        Two attempts can briefly both run a child (the older one learns of the newer
        at its next heartbeat); only the one whose attempt is the run's current one may
        record, so a resumed run never mixes two histories.
        """
        event = RunStepRecorded(
            event_id=self._event_id("step", index), run_id=self.run_id,
            parent=self.parent, occurred_at=SYSTEM_CLOCK.now(), correlation_id=self.run_id,
            causation_id=self._causation_id, data=RunStepRecordedData(index=index, step=step))

        state, appended = await self._update(
            partial(decide.record_step, step=event, index=index, attempt=self._attempt,
                    incarnation=self._incarnation))
        if appended:
            return
        if state is None or state.is_hard_terminal:
            ended = "was cleared" if state is None else f"ended {state.status}"
            raise RunSuperseded(f"the run {ended} while the child ran", reason="gone")
        if state.attempt != self._attempt:
            raise RunSuperseded(f"attempt {state.attempt} took over the run")
        # Same attempt and the index is there: our own append, acknowledged late.

    # --- steering messages --------------------------------------------------------------

    async def message_receipt(self, kind: str, message_id: str) -> RunState | None:
        """`run.message_delivered` or `run.message_consumed` ("delivered", "consumed") of a
        steering message, once, while this attempt holds the run; the run after it."""
        def decision(current: RunState | None) -> list[Event]:
            if current is None:
                return []
            receipt = decide.message_receipt_event(current, kind, message_id, self._attempt,
                                                   SYSTEM_CLOCK.now(), self._causation_id)
            return decide.message_receipt(current, receipt, attempt=self._attempt,
                                          incarnation=self._incarnation)

        state, _ = await self._update(decision)
        return state

    # --- output -----------------------------------------------------------------------

    async def output(self, text: str) -> None:
        async with self._output_lock:
            text = self._skip_replayed(text)
            if not text:
                return
            index = self._next_index
            await self._append(RunOutput(
                event_id=self._event_id("out", index), run_id=self.run_id,
                parent=self.parent, occurred_at=SYSTEM_CLOCK.now(), correlation_id=self.run_id,
                causation_id=self._causation_id, data=RunOutputData(index=index, text=text)))
            self._next_index += 1
            self._new_text.append(text)

    def _skip_replayed(self, text: str) -> str:
        """The part of `text` that is not a re-emission of already recorded output."""
        remaining = self._recorded_text[self._replayed_chars:]
        if not remaining:
            return text
        if remaining.startswith(text):
            self._replayed_chars += len(text)
            return ""
        if text.startswith(remaining):
            self._replayed_chars = len(self._recorded_text)
            return text[len(remaining):]
        # The child said something else this time. What was recorded stays; the new text
        # follows it rather than being lost.
        self._logger().warning("child.output_diverged_on_resume", attempt=self._attempt,
                               recorded_chars=len(self._recorded_text),
                               matched_chars=self._replayed_chars)
        self._replayed_chars = len(self._recorded_text)
        return text

    # --- ephemeral progress -----------------------------------------------------------

    async def progress(self, *, fraction: float | None, message: str | None, phase: str | None,
                       data: Any, persist: bool) -> None:
        """Coalesce: latest value wins, at most one send per window.

        `fraction >= 1` is sent at once, and a value still waiting for its window is
        dropped: the end supersedes it (latest value wins, and a `fraction >= 1` frame is
        always sent). A milestone, always sent too, supersedes it the same way.

        Snapshots reach the log at most once per persist window (`persist` ones at once):
        the latest one when its window ends, or before the run's outcome or pause. One
        that a milestone (itself a later snapshot) follows before then is not written:
        the run's state after the milestone is the same with or without it.
        """
        # Dated when reported: values are sent in the order reported, each later than
        # the one before (`_next_at`), whenever its window lets it go.
        update = ProgressSnapshot(fraction=fraction, message=message, phase=phase, data=data,
                                  at=self._next_at())
        if fraction is not None and fraction >= 1:
            self._drop_pending()
            await self._send(update, persist)  # after any send under way (the send lock)
            return
        elapsed = time.monotonic() - self._last_send
        if self._pending is None and self._timer is None and elapsed >= self._window_s:
            await self._send(update, persist)
            return
        self._pending, self._pending_persist = update, persist
        if self._timer is None:
            delay = max(0.0, self._window_s - elapsed)
            self._timer = asyncio.get_running_loop().call_later(delay, self._send_when_due)

    def _drop_pending(self) -> None:
        timer, self._timer, self._pending = self._timer, None, None
        if timer is not None:
            timer.cancel()

    def _send_when_due(self) -> None:
        # From here on the send belongs to its task; `flush` waits for it (the send lock)
        # instead of cancelling it half-way, or sends the pending value itself when it
        # runs before the task takes it.
        self._timer = None
        self._start(self._send_pending(), "progress")

    def _start(self, send: Coroutine[Any, Any, None], what: str) -> None:
        task = asyncio.ensure_future(_unless_superseded(send))
        task.set_name(f"{what}:{self.run_id}")
        self._fired.add(task)
        task.add_done_callback(self._fired.discard)

    async def flush(self, *, persist: bool = False) -> None:
        """Send the pending coalesced signal now and wait until every send has landed;
        with `persist`, also put the latest snapshot not yet in the log there.

        The runner calls this with `persist` before appending the run's outcome, so the
        run's last reported progress is in the log and none lands after the outcome.
        """
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        await self._send_pending()
        if persist:
            persist_timer, self._persist_timer = self._persist_timer, None
            if persist_timer is not None:
                persist_timer.cancel()
            await self._persist_latest()
        async with self._send_lock:
            pass

    async def _send_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await self._send(pending, self._pending_persist)

    async def _send(self, update: ProgressSnapshot, persist: bool) -> None:
        async with self._send_lock:
            self._last_send = time.monotonic()
            try:
                await self._publish_signal(update, persist)
                if persist or time.monotonic() - self._last_persist >= self._persist_window_s:
                    await self._persist(update, persist)
                else:
                    self._unpersisted = update
                    if self._persist_timer is None:
                        delay = self._last_persist + self._persist_window_s - time.monotonic()
                        self._persist_timer = asyncio.get_running_loop().call_later(
                            max(delay, 0.0), self._persist_when_due)
            except RunSuperseded:
                raise  # the attempt may report no more: its child is being stopped
            except Exception as error:  # noqa: BLE001 - progress is best effort; the run goes on
                self._warn_send_failure(error)

    def _snapshot_recorded(self) -> None:
        """A milestone just reached the log: it supersedes the snapshot waiting for its
        window, and the window starts again. (Called holding the send lock.)"""
        self._unpersisted = None
        self._last_persist = time.monotonic()
        persist_timer, self._persist_timer = self._persist_timer, None
        if persist_timer is not None:
            persist_timer.cancel()

    def _persist_when_due(self) -> None:
        self._persist_timer = None  # from here on `flush` waits for it, as for a send
        self._start(self._persist_latest(), "persist")

    async def _persist_latest(self) -> None:
        async with self._send_lock:
            if self._unpersisted is None:
                return
            try:
                await self._persist(self._unpersisted, persist=False)
            except RunSuperseded:
                raise
            except Exception as error:  # noqa: BLE001 - as in `_send`
                self._warn_send_failure(error)

    async def _persist(self, update: ProgressSnapshot, persist: bool) -> None:
        """The snapshot of a signal already sent, with the signal's own time; its data
        only when the child asked for it to persist."""
        self._progress_count += 1
        await self._append(RunProgressPersisted(
            event_id=self._event_id("progress", self._attempt, self._progress_count),
            run_id=self.run_id, parent=self.parent, occurred_at=update.at,
            correlation_id=self.run_id, causation_id=self._causation_id,
            data=RunProgressPersistedData(
                fraction=update.fraction, message=update.message, phase=update.phase,
                data=update.data if persist else None),
        ))
        self._unpersisted = None
        self._last_persist = time.monotonic()

    def _warn_send_failure(self, error: Exception) -> None:
        if not self._warned_send_failure:
            self._warned_send_failure = True
            self._logger().warning("child.progress_not_sent",
                                   error=f"{type(error).__name__}: {error}")

    async def _publish_signal(self, update: ProgressSnapshot, persist: bool) -> None:
        await self.ensure_current()
        signal = progress_signal_json(self.run_id, self.parent, fraction=update.fraction,
                                      message=update.message, phase=update.phase,
                                      milestone=update.milestone, data=update.data,
                                      at=update.at)
        # A plain publish: the progress stream keeps it for late subscribers, and no ack
        # is awaited for a signal the next one supersedes (the log has the snapshot).
        # Data not asked to persist is live only: the stream lets it go at once.
        if update.data is not None and not persist:
            await self._log.notify(self._progress_subject, signal, headers=LIVE_ONLY_HEADERS)
        else:
            await self._log.notify(self._progress_subject, signal)

    def _next_at(self) -> int:
        self._last_at = max(SYSTEM_CLOCK.now(), self._last_at + 1)
        return self._last_at


async def _unless_superseded(send: Coroutine[Any, Any, None]) -> None:
    """A send a timer started: an attempt that may no longer report is being stopped by
    its runner already, and the send has nobody to tell."""
    with suppress(RunSuperseded):
        await send
