"""The fast path of finish hooks and chat notifications for detached runs.

A durable consumer follows every run event. When a detached run ends it publishes the
finish hook (`finish:<run_id>:<status>`) and, when the application registered one, the
parent agent's global finish hook; without `on_finish`, `notify` puts one chat message
per (run, status); `on_milestones` puts one per (run, milestone name). Message ids are
deterministic, so a redelivered event publishes a duplicate the stream drops; the
delivery ledger in the run's events (written after the chat message, and by the hook
handler after the user's function returns) stops a delivery after a restart.

Run states are folded from the events as they pass, in a bounded cache; a run not in
the cache is read from the log once. `evolve` is idempotent, so applying events the
read already contained changes nothing. Most events owe nothing: they are judged in the
batch's own turn and acknowledged with it; only a run whose event waits on the log (a
delivery, a read) gets a task, which takes that run's later events in order.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import cast

from nats.aio.msg import Msg
from nats.js import api as js_api

from tether import tracing
from tether.adapters.deliveries import DeliveryRecords
from tether.adapters.event_log import EventLog, to_stored_event
from tether.adapters.pull import delivery_of, durable_pull
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    GLOBAL_FINISH_HOOK,
    ChatMessage,
    HookMessage,
    LifecycleResult,
    MilestoneView,
    RunInfo,
    chat_finish_id,
    chat_milestone_id,
    finish_message_id,
    record_delivery_of_this_life,
)
from tether.delivery.formatters import Formatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.domain.commands import DeliveredCommand
from tether.domain.events import (
    TERMINAL_EVENT_STATUS,
    Event,
    NotifyOptions,
    RunAborted,
    RunCompleted,
    RunFailed,
    RunInterrupted,
    RunMilestone,
    RunNotified,
    RunNotifiedData,
    RunRequested,
)
from tether.domain.run_state import RunState, evolve
from tether.ports import StoredEvent
from tether.resilience import TRANSIENT_ERRORS, describe, is_transient, settle, supervise

# Bounded, so the parent's memory does not grow with the runs it has seen; a run that
# fell out is read from the log once if it moves again.
CACHE_SIZE = 2_000

RunKey = tuple[str, str, str]
Owed = Callable[[], Awaitable[None]]  # what an event still owes, to be awaited
OUTCOMES = (RunCompleted, RunFailed, RunAborted, RunInterrupted)  # TERMINAL_EVENT_STATUS's
_MISSING = object()  # not in the cache
_AWAITED = object()  # an awaited run: the deliverer owes it nothing


def result_of(event: RunCompleted | RunFailed | RunAborted | RunInterrupted) -> LifecycleResult:
    """The outcome an event reports, independent of what happened to the run since."""
    if isinstance(event, RunCompleted):
        return LifecycleResult(status="completed", summary=event.data.summary,
                               output=event.data.output)
    if isinstance(event, RunInterrupted):
        return LifecycleResult(status="interrupted", error=event.data.error,
                               reason=event.data.reason,
                               child_still_running=event.data.child_still_running)
    status = "error" if isinstance(event, RunFailed) else "aborted"
    return LifecycleResult(status=status, error=event.data.error)


class Deliverer:
    def __init__(self, log: EventLog, hooks: RegisteredHooks, formatters: Formatters, logger, *,
                 consumer: str = "parent-deliverer", batch: int = 256,
                 duplicate_window_ms: int = 0, delivery_lease_ms: int | None = None,
                 records: DeliveryRecords | None = None) -> None:
        """`duplicate_window_ms`: the hooks stream's; a hook published within half of it
        after its outcome, and within half of `delivery_lease_ms` (before the reconciler
        may have published a retry of its own), is marked as its first publication
        (0: never marked)."""
        self._log = log
        self._js = log.jetstream
        self._hooks = hooks
        self._formatters = formatters
        self._logger = logger
        self._consumer = consumer
        self._batch = batch
        self._states: OrderedDict[RunKey, object] = OrderedDict()  # RunState, None, _AWAITED
        self._first_within_ms = min(duplicate_window_ms,
                                    delivery_lease_ms or duplicate_window_ms) // 2
        self._records = records or DeliveryRecords(None)
        self.delivered = 0

    @property
    def tracked_runs(self) -> int:
        """Runs whose state (or awaited-ness) is kept; never more than CACHE_SIZE."""
        return len(self._states)

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until `stop`; a broker error binds to the consumer again after a
        backoff (events not acknowledged come back and are judged again)."""
        await supervise("deliveries", lambda progressed: self._deliver(stop, progressed),
                        stop, self._logger)

    async def _deliver(self, stop: asyncio.Event, progressed: Callable[[], None]) -> None:
        subjects = self._log.subjects
        config = js_api.ConsumerConfig(
            durable_name=self._consumer, ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=js_api.DeliverPolicy.ALL, ack_wait=30, max_deliver=-1,
            max_ack_pending=self._batch * 4, filter_subject=subjects.all_events,
        )
        subscription = await durable_pull(self._js, self._log.nats, subjects.events_stream, config)
        try:
            while not stop.is_set():
                try:
                    messages = await subscription.fetch(self._batch, timeout=0.5)
                except TimeoutError:
                    if self._log.nats.is_connected:
                        progressed()
                    continue
                progressed()
                # One run's events in order; different runs' concurrently (each run
                # subject is one key of the state cache, so they never share a state).
                by_run: dict[str, list[Msg]] = {}
                for msg in messages:
                    by_run.setdefault(msg.subject, []).append(msg)
                # Most events owe nothing and are judged at once; a task is started only
                # for a run whose event must wait on the log (a delivery, a read).
                done: list[Msg] = []
                failed: list[Msg] = []
                waiting = [self._handle_in_order(rest) for run in by_run.values()
                           if (rest := self._judge_at_once(run, done, failed))]
                if waiting:
                    await asyncio.gather(*waiting)
                for msg in failed:
                    await settle(msg.nak(delay=1.0), logger=self._logger, what="delivery.nak")
                for msg in done:
                    await settle(msg.ack(), logger=self._logger, what="delivery.ack")
        finally:
            with suppress(*TRANSIENT_ERRORS):
                await subscription.unsubscribe()

    def _judge_at_once(self, messages: list[Msg], done: list[Msg],
                       failed: list[Msg]) -> "list[tuple[Msg, StoredEvent | None, Owed | None]]":
        """Judge one run's events in order until one owes something: that one, with what
        it owes, and the ones after it, to be judged after it. The others go to `done`
        (or `failed`)."""
        for index, msg in enumerate(messages):
            delivery = delivery_of(msg)
            stored = to_stored_event(delivery.stream_seq, msg.subject, msg.data)
            try:
                owed = self._judge(stored, first_delivery=delivery.delivered == 1)
            except Exception:
                self._logger.exception("delivery.failed", stream_seq=stored.seq)
                self._forget(stored)
                failed.append(msg)
                continue
            if owed is not None:
                return [(msg, stored, owed),
                        *((later, None, None) for later in messages[index + 1:])]
            done.append(msg)
        return []

    async def _handle_in_order(
            self, items: "list[tuple[Msg, StoredEvent | None, Owed | None]]") -> None:
        for msg, stored, owed in items:
            try:
                if stored is None:
                    delivery = delivery_of(msg)
                    stored = to_stored_event(delivery.stream_seq, msg.subject, msg.data)
                    owed = self._judge(stored, first_delivery=delivery.delivered == 1)
                if owed is not None:
                    await (owed() if not tracing.ENABLED else self._traced(msg, owed))
            except Exception as error:
                seq = delivery_of(msg).stream_seq
                if is_transient(error):  # the broker: it comes back, and so does the event
                    self._logger.warning("delivery.failed", stream_seq=seq, error=describe(error))
                else:
                    self._logger.exception("delivery.failed", stream_seq=seq)
                self._forget(stored)
                await settle(msg.nak(delay=1.0), logger=self._logger, what="delivery.nak")
                continue
            await settle(msg.ack(), logger=self._logger, what="delivery.ack")

    async def _traced(self, msg: Msg, owed: "Owed") -> None:
        """What a run's event owes, in the trace of the event's writer (a run's outcome:
        its child's run)."""
        subject = self._log.subjects.all_events
        with tracing.span(f"process {subject}", tracing.CONSUMER, carrier=msg.headers or {},
                          attributes=tracing.messaging_attributes("process", subject)):
            await owed()

    def _forget(self, stored: "StoredEvent | None") -> None:
        """After a failure: the run is read again when its event comes back."""
        if stored is not None and stored.event is not None:
            self._states.pop(_key(stored), None)

    def _judge(self, stored: StoredEvent, *, first_delivery: bool) -> "Owed | None":
        """Apply one event to the run's cached state; what it still owes, to be awaited
        (a delivery, or the run's read when its state is not at hand), or None.

        Only an outcome, or a milestone of a run that asked for milestones, can owe
        anything, so a run is read from the log only at such an event when its state is
        not at hand; a run that owes nothing more (awaited, or finished and delivered)
        is not kept.
        """
        event = stored.event
        if event is None:
            return None
        key = _key(stored)
        cached = self._states.get(key, _MISSING)
        if cached is _AWAITED:
            if not isinstance(event, RunRequested):
                return None
            cached = _MISSING  # requested again after a clear: judged afresh
        if cached is _MISSING:
            if isinstance(event, RunRequested):
                if first_delivery:
                    # The log only takes run.requested for a run with no state (the parent
                    # appends it expecting that), so the run starts here: nothing to read.
                    self._keep(key, evolve(None, event).state)
                    return None
            elif event.type not in TERMINAL_EVENT_STATUS and not isinstance(event, RunMilestone):
                return None  # owes nothing; an outcome or milestone reads the run when it comes
            return lambda: self._read_and_deliver(key, stored, first_delivery)
        evolved = evolve(cast("RunState | None", cached), event)
        self._keep(key, evolved.state)
        return self._owed(key, stored, evolved.state, evolved.applied, first_delivery)

    async def _read_and_deliver(self, key: RunKey, stored: StoredEvent,
                                first_delivery: bool) -> None:
        # The run as it was just before this event, so that this event (and the ones
        # after it) are judged by the same fold as on the warm path.
        event = _event(stored)
        before = (await self._log.read_run(event.parent, event.run_id,
                                           before_seq=stored.seq)).state
        evolved = evolve(before, event)
        self._keep(key, evolved.state)
        owed = self._owed(key, stored, evolved.state, evolved.applied, first_delivery)
        if owed is not None:
            await owed()

    def _owed(self, key: RunKey, stored: StoredEvent, state: RunState | None, applied: bool,
              first_delivery: bool) -> "Owed | None":
        event = _event(stored)
        if state is None or state.detached is None or not applied:
            return None
        if isinstance(event, OUTCOMES):
            return lambda: self._deliver_outcome(key, stored, state, first_delivery)
        if isinstance(event, RunMilestone) and self._milestone_owed(state, event):
            return lambda: self._milestone(state, event)
        return None

    async def _deliver_outcome(self, key: RunKey, stored: StoredEvent, state: RunState,
                               first_delivery: bool) -> None:
        event = _event(stored)
        assert isinstance(event, OUTCOMES)  # `_owed` sends only outcomes here
        if not (isinstance(event, RunAborted) and event.data.cause == "give-up"):
            # (the give-up already delivered its interrupted hook)
            # No hook for this outcome was published before this one, or one was so
            # recently that the stream drops this one as a duplicate: the hook the
            # handler gets is the only one (half the window: clocks may differ).
            first = first_delivery and _now_ms() - event.occurred_at < self._first_within_ms
            await self.deliver_finish(state, result_of(event), first=first)
        # The run owes nothing more until another outcome, which reads it again. What
        # we know of it goes to the log's cache: the application's delivery record
        # is usually the next event, and is then decided without a read.
        self._states.pop(key, None)
        self._log.recent_runs.remember_run(event.parent, event.run_id, state, stored.seq)

    def _keep(self, key: RunKey, state: RunState | None) -> None:
        """Keep a detached run's state; of an awaited run only that it is one."""
        self._remember(key, _AWAITED if state is not None and state.detached is None
                       else state)

    def _remember(self, key: RunKey, state: "RunState | object | None") -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > CACHE_SIZE:
            self._states.popitem(last=False)

    async def deliver_finish(self, state: RunState, result: LifecycleResult,
                             retry: int = 0, *, first: bool = False) -> int:
        """Publish what the ledger says is still owed for this outcome; how many messages.

        `retry` > 0 (the reconciler, after a lease) gives hook messages a new id, since
        the first one may still be inside the stream's duplicate window. `first`: no other
        message with these ids can reach the handler, which then need not read the ledger
        (`FIRST_PUBLICATION_HEADER`). A retry first looks for the handler's own record
        of the delivery (`DeliveryRecords`).
        """
        options = state.detached
        if options is None:
            return 0  # an awaited run: its outcome went to the awaiting client
        info = RunInfo.of(state)
        first = first and not retry
        published = 0
        methods = []
        if options.on_finish and not state.finish_delivered(result.status, options.on_finish):
            methods.append(options.on_finish)
        if (not state.finish_delivered(result.status, GLOBAL_FINISH_HOOK)
                and await self._hooks.has(state.parent.agent, GLOBAL_FINISH_HOOK)):
            methods.append(GLOBAL_FINISH_HOOK)
        for method in methods:
            if retry and await self._recorded_by_handler(state, result.status, method):
                continue
            await self._publish_hook(state, method, info, result, retry, first)
            published += 1
        # An explicit on_finish takes precedence over notify.
        if options.on_finish or not options.notify:
            return published
        ledger_key = f"finish:{result.status}"
        if ledger_key in state.ledger.notifications:
            return published
        text = self._formatters.format_detached_completion(info, result)
        if text:
            message = ChatMessage(id=chat_finish_id(state, result.status), role="user",
                                  content=text, metadata={
                                      "source": _source(state), "run_id": state.run_id,
                                      "agent_type": state.agent_type, "kind": "finish",
                                      "status": result.status})
            await self._publish_chat(state, message)
            published += 1
        await self._record_notified(state, "finish", result.status, "notify",
                                    chat_finish_id(state, result.status))
        return published

    async def _recorded_by_handler(self, state: RunState, status: str, method: str) -> bool:
        """Whether the application's handler recorded this hook's delivery while the
        ledger has not heard of it (the parent was down, or is behind): then the ledger
        entry is appended here, and the hook is not published again."""
        message_id = finish_message_id(state, status, method)
        if not await self._records.recorded(state.parent, method, message_id):
            return False
        command = DeliveredCommand(run_id=state.run_id, parent=state.parent, status=status,
                                   method=method, message_id=message_id)
        await self._log.update(state.parent, state.run_id,
                               lambda s: record_delivery_of_this_life(s, command, _now_ms()))
        self._logger.info("delivery.recorded_by_handler", run_id=state.run_id, method=method,
                          status=status)
        return True

    @staticmethod
    def _milestone_owed(state: RunState, event: RunMilestone) -> bool:
        name = event.data.name
        return (state.detached is not None and name in state.detached.milestone_names()
                and f"milestone:{name}" not in state.ledger.notifications)

    async def _milestone(self, state: RunState, event: RunMilestone) -> None:
        options = state.detached
        assert options is not None  # `_milestone_owed` said it asked for milestones
        name = event.data.name
        mode = options.milestone_mode()
        milestone = MilestoneView(sequence=event.data.sequence, name=name, data=event.data.data,
                                  at=event.occurred_at)
        text = self._formatters.format_detached_milestone(RunInfo.of(state), milestone)
        message_id = chat_milestone_id(state, name)
        if text:
            # narrate: a status line from the assistant, no model turn; react: a user turn.
            role = "assistant" if mode == "narrate" else "user"
            await self._publish_chat(state, ChatMessage(id=message_id, role=role, content=text,
                                                        metadata={
                "source": _source(state), "run_id": state.run_id,
                "agent_type": state.agent_type, "kind": "milestone", "milestone": name,
                "sequence": event.data.sequence, "mode": mode}))
        await self._record_notified(state, "milestone", name, mode, message_id)

    async def _publish_hook(self, state: RunState, method: str, info: RunInfo,
                            result: LifecycleResult, retry: int = 0,
                            first: bool = False) -> None:
        message = HookMessage(method=method, run=info, result=result)
        message_id = finish_message_id(state, result.status, method)
        if retry:
            message_id = f"{message_id}:retry{retry}"
        headers = {"Nats-Msg-Id": message_id}
        if first:
            headers[FIRST_PUBLICATION_HEADER] = "1"
        subject = self._log.subjects.hook(state.parent.agent, method)
        payload = message.model_dump_json().encode()
        if not tracing.ENABLED:
            await self._log.publish(subject, payload, headers=headers,
                                    stream=self._log.subjects.hooks_stream)
        else:
            with tracing.span(f"send {subject}", tracing.PRODUCER,
                              attributes=tracing.messaging_attributes(
                                  "send", subject, **{"tether.run.id": state.run_id,
                                                      "tether.hook.method": method})):
                await self._log.publish(subject, payload, headers=headers,
                                        stream=self._log.subjects.hooks_stream)
        self.delivered += 1
        self._logger.info("delivery.hook_published", run_id=state.run_id, method=method,
                          status=result.status)

    async def _publish_chat(self, state: RunState, message: ChatMessage) -> None:
        await self._log.publish(self._log.subjects.chat(state.parent),
                                message.model_dump_json().encode(),
                                headers={"Nats-Msg-Id": message.id},
                                stream=self._log.subjects.chat_stream)
        self.delivered += 1

    async def _record_notified(self, state: RunState, kind: str, key: str, mode: str,
                               message_id: str) -> None:
        def decide(current: RunState | None) -> list:
            if (current is None or current.incarnation != state.incarnation
                    or f"{kind}:{key}" in current.ledger.notifications):
                return []  # cleared (and perhaps requested again), or already recorded
            return [RunNotified(
                event_id=state.event_id("notified", kind, key),
                run_id=state.run_id, parent=state.parent, occurred_at=_now_ms(),
                causation_id=message_id, correlation_id=state.run_id,
                data=RunNotifiedData(kind=kind, key=key, mode=mode, message_id=message_id))]

        await self._log.update(state.parent, state.run_id, decide)


def _source(state: RunState) -> str:
    notify = state.detached.notify if state.detached else None
    return notify.source if isinstance(notify, NotifyOptions) else "agent-tool"


def _event(stored: StoredEvent) -> Event:
    """The event of a stored message the deliverer judges (one that decoded)."""
    assert stored.event is not None
    return stored.event


def _key(stored: StoredEvent) -> RunKey:
    event = _event(stored)
    return (event.parent.agent, event.parent.name, event.run_id)


def _now_ms() -> int:
    return int(time.time() * 1000)
