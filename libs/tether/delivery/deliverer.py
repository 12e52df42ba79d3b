"""The finish hooks and chat notifications a detached run owes, published by whoever
appended what owes them.

The writer of a run's outcome delivers it right after its append (the child-runner for its
child's outcome, the parent for a cancel, the reconciler for a give-up), and the runner
puts a milestone's chat notification out right after recording the milestone: one hop,
and no consumer of the whole log. Message ids are deterministic, so a repeat publishes a
duplicate the stream drops; the delivery ledger in the run's events (`run.finish_delivered`,
which the hook handler's report appends, or an entry of its parent agent's batch that a
follower of the log reads as one, and `run.notified`, appended here after a chat
message) stops a delivery after the stream's window. A writer that died between its
append and the delivery leaves it to the next: a redelivered work item or command finds
the run ended and delivers what the ledger still lacks (`deliver_owed`), and the
reconciler republishes a finish hook not acknowledged within its lease.
"""

import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Literal

from tether import tracing
from tether.adapters.deliveries import DeliveryRecords, delivery_key
from tether.adapters.event_log import EventLog as JetStreamEventLog
from tether.adapters.streams import StreamSettings, key_value
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    ChatMessage,
    LifecycleResult,
    MilestoneView,
    RunInfo,
    hook_message_json,
)
from tether.delivery.formatters import Formatters
from tether.delivery.handler_holds import Sighting, still_held
from tether.delivery.registered_hooks import RegisteredHooks
from tether.domain.chat import notice_chat
from tether.domain.commands import DeliveredCommand
from tether.domain.decide import GIVE_UP, record_delivery_of_this_life
from tether.domain.detached_options import NotifyOptions
from tether.domain.events import (
    Event,
    RunAborted,
    RunCompleted,
    RunFailed,
    RunInterrupted,
    RunNotified,
    RunNotifiedData,
)
from tether.domain.ids import (
    GLOBAL_FINISH_HOOK,
    chat_finish_id,
    chat_milestone_id,
    finish_message_id,
)
from tether.domain.recorded import Milestone
from tether.domain.run_state import RunState
from tether.ports import SYSTEM_CLOCK, Clock, EventLog

if TYPE_CHECKING:
    from tether.config import Settings

# How many hooks' handler marks a deliverer remembers between its retries (a safety net:
# one per hook whose call runs past a retry).
SIGHTINGS_KEPT = 10_000
OUTCOMES = (RunCompleted, RunFailed, RunAborted, RunInterrupted)  # TERMINAL_EVENT_STATUS's


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
                 duplicate_window_ms: int = 0, delivery_lease_ms: int | None = None,
                 records: DeliveryRecords | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        """`duplicate_window_ms`: the hooks stream's; a hook published within half of it
        after its outcome, and within half of `delivery_lease_ms` (before the reconciler
        may have published a retry of its own), is marked as its first publication
        (0: never marked). `clock` stamps what it writes."""
        self._log = log
        self._hooks = hooks
        self._formatters = formatters
        self._logger = logger
        self._first_within_ms = min(duplicate_window_ms,
                                    delivery_lease_ms or duplicate_window_ms) // 2
        self._records = records or DeliveryRecords(None)
        self._clock = clock
        self._sightings: dict[str, Sighting] = {}  # the handlers' marks seen by a retry
        self.delivered = 0

    @classmethod
    async def open(cls, settings: "Settings", log: JetStreamEventLog, formatters: Formatters,
                   logger, *,
                   records: bool = True) -> "Deliverer":
        """The services' deliverer, one way wherever it is needed: the installation's hook
        registry, its delivery records (`records`: kept by the parent and the reconciler)
        and `formatters` (`formatters.parent_formatters`)."""
        js = log.jetstream
        hooks = RegisteredHooks(await key_value(js, settings.subjects.registry_bucket,
                                                StreamSettings.of(settings)))
        kept = (await DeliveryRecords.open(js, settings.subjects.deliveries_bucket)
                if records else None)
        return cls.of(settings, log, hooks, formatters, logger, kept)

    @property
    def hooks(self) -> RegisteredHooks:
        """The hook registry it delivers by."""
        return self._hooks

    @classmethod
    def of(cls, settings: "Settings", log: EventLog, hooks: RegisteredHooks,
           formatters: Formatters, logger, records: DeliveryRecords | None = None
           ) -> "Deliverer":
        """One with the installation's duplicate window and delivery lease."""
        return cls(log, hooks, formatters, logger, records=records,
                   duplicate_window_ms=settings.duplicate_window_ms,
                   delivery_lease_ms=settings.delivery_lease_ms)

    async def deliver_outcome(self, state: RunState | None, event: Event) -> int:
        """What the outcome `event`, just appended by the caller, owes; `state` is the run
        right after it. Its first publication: no hook for this outcome can have gone out
        before (the handler then need not read the ledger), unless the append took so
        long that a retry of the reconciler's may have."""
        if (state is None or state.detached is None or not isinstance(event, OUTCOMES)
                or (isinstance(event, RunAborted) and event.data.cause == GIVE_UP)):
            return 0  # (a give-up's interruption already delivered its hook)
        first = self._clock.now() - event.occurred_at < self._first_within_ms
        return await self.deliver_finish(state, result_of(event), first=first)

    async def deliver_after(self, state: RunState | None, appended: Sequence[Event]) -> int:
        """What the events the caller just appended owe (`state`: the run after them);
        when it appended nothing to a run that has ended (a command or work item handled
        again, after a writer that died before delivering), what the run still owes."""
        if appended:
            published = 0
            for event in appended:
                published += await self.deliver_outcome(state, event)
            return published
        if state is not None and not state.is_open:
            return await self.deliver_owed(state)
        return 0

    async def deliver_owed(self, state: RunState | None) -> int:
        """Whatever the run's ledger says it still owes: its outcome's hooks or
        notification, and its milestones' notifications. For a writer's successor that
        finds the run ended or its milestones recorded (the writer may have died before
        delivering); a delivery already made is a repeat the stream or the handler drops."""
        if state is None or state.detached is None:
            return 0
        published = 0
        notified: set[str] = set()  # one message per name: its first milestone's
        for milestone in state.milestones:
            if milestone.name not in notified and self.owes_notification(state, milestone.name):
                notified.add(milestone.name)
                await self.notify_milestone(state, milestone)
                published += 1
        if not state.is_open and not (state.status == "aborted"
                                      and state.aborted_cause == GIVE_UP):
            published += await self.deliver_finish(state, LifecycleResult.of(state))
        return published

    async def deliver_finish(self, state: RunState, result: LifecycleResult,
                             retry: int = 0, *, first: bool = False) -> int:
        """Publish what the ledger says is still owed for this outcome; how many messages
        are on their way (published now, or held by a handler calling the function).

        `retry` > 0 (the reconciler, after a lease) gives hook messages a new id, since
        the first one may still be inside the stream's duplicate window. `first`: no other
        message with these ids can reach the handler, which then need not read the ledger
        (`FIRST_PUBLICATION_HEADER`). A retry first looks for the handler's own record
        of the delivery (`DeliveryRecords`), then for its mark of a call under way: a hook
        whose handler is still calling the function (a slow one, or one that raised and
        is tried again after its lease) is not published again, since the copy would go
        to another replica and call the function a second time meanwhile.
        """
        options = state.detached
        if options is None:
            return 0  # an awaited run: its outcome went to the awaiting client
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
            if retry and await self._held_by_handler(state, result.status, method):
                published += 1
                continue
            await self._publish_hook(state, method, result, retry, first)
            published += 1
        # An explicit on_finish takes precedence over notify.
        if options.on_finish or not options.notify:
            return published
        ledger_key = f"finish:{result.status}"
        if ledger_key in state.ledger.notifications:
            return published
        text = self._formatters.format_detached_completion(RunInfo.of(state), result)
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
        await self._log.recent.update(state.parent, state.run_id, partial(
            record_delivery_of_this_life, command=command, now=self._clock.now()))
        self._logger.info("delivery.recorded_by_handler", run_id=state.run_id, method=method,
                          status=status)
        return True

    async def _held_by_handler(self, state: RunState, status: str, method: str) -> bool:
        """Whether a handler's mark says it is calling this hook's function now
        (`handler_holds.still_held`)."""
        message_id = finish_message_id(state, status, method)
        key = delivery_key(state.parent, method, message_id)
        mark = await self._records.held(state.parent, method, message_id)
        if mark is None:
            self._sightings.pop(key, None)
            return False
        held, sighting = still_held(mark.revision, mark.lease_ms, self._sightings.get(key),
                                    time.monotonic())
        if not held:
            self._sightings.pop(key, None)
            self._logger.warning("delivery.handler_gone", run_id=state.run_id, method=method,
                                 status=status, detail=(
                                     "a handler's mark of its call was not renewed for two "
                                     "of its leases: published again"))
            return False
        if len(self._sightings) >= SIGHTINGS_KEPT:
            self._sightings.clear()
        self._sightings[key] = sighting
        self._logger.info("delivery.held_by_handler", run_id=state.run_id, method=method,
                          status=status, detail="a handler is calling the function: "
                                                "not published again")
        return True

    @staticmethod
    def owes_notification(state: RunState, name: str) -> bool:
        """Whether the run asked for a chat message at milestone `name` and has none yet."""
        return (state.detached is not None and name in state.detached.milestone_names()
                and f"milestone:{name}" not in state.ledger.notifications)

    async def notify_milestone(self, state: RunState, milestone: Milestone) -> None:
        """The chat message of a milestone the run asked for (`owes_notification`), and its
        ledger entry."""
        options = state.detached
        assert options is not None  # `owes_notification` said it asked for milestones
        name = milestone.name
        mode = options.milestone_mode()
        view = MilestoneView(sequence=milestone.sequence, name=name, data=milestone.data,
                             at=milestone.at)
        text = self._formatters.format_detached_milestone(RunInfo.of(state), view)
        message_id = chat_milestone_id(state, name)
        if text:
            # narrate: a status line from the assistant, no model turn; react: a user turn.
            role = "assistant" if mode == "narrate" else "user"
            await self._publish_chat(state, ChatMessage(id=message_id, role=role, content=text,
                                                        metadata={
                "source": _source(state), "run_id": state.run_id,
                "agent_type": state.agent_type, "kind": "milestone", "milestone": name,
                "sequence": milestone.sequence, "mode": mode}))
        await self._record_notified(state, "milestone", name, mode, message_id)

    async def _publish_hook(self, state: RunState, method: str, result: LifecycleResult,
                            retry: int = 0, first: bool = False) -> None:
        message_id = finish_message_id(state, result.status, method)
        if retry:
            message_id = f"{message_id}:retry{retry}"
        headers = {"Nats-Msg-Id": message_id}
        if first:
            headers[FIRST_PUBLICATION_HEADER] = "1"
        subject = self._log.subjects.hook(state.parent.agent, method)
        payload = hook_message_json(method, state, result)
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
        await self._log.publish(self._log.subjects.chat(*notice_chat(state)),
                                message.model_dump_json().encode(),
                                headers={"Nats-Msg-Id": message.id},
                                stream=self._log.subjects.chat_stream)
        self.delivered += 1

    async def _record_notified(self, state: RunState, kind: Literal["finish", "milestone"],
                               key: str, mode: Literal["notify", "narrate", "react"],
                               message_id: str) -> None:
        def decide(current: RunState | None) -> list:
            if (current is None or current.incarnation != state.incarnation
                    or f"{kind}:{key}" in current.ledger.notifications):
                return []  # cleared (and perhaps requested again), or already recorded
            return [RunNotified(
                event_id=state.event_id("notified", kind, key),
                run_id=state.run_id, parent=state.parent, occurred_at=self._clock.now(),
                causation_id=message_id, correlation_id=state.run_id,
                data=RunNotifiedData(kind=kind, key=key, mode=mode, message_id=message_id))]

        await self._log.recent.update(state.parent, state.run_id, decide)


def _source(state: RunState) -> str:
    notify = state.detached.notify if state.detached else None
    return notify.source if isinstance(notify, NotifyOptions) else "agent-tool"

