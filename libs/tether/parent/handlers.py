"""The parent's command handlers (`CommandHandlers`): run (its base, `RunRequests` in
`tether.parent.run_requests`), cancel, continue, send, message, delivered and clear.

Each handler parses, loads the run from the log, decides with the pure functions of
`tether.domain.decide`, and appends with optimistic concurrency (`EventLog.update`), so
concurrent requests for one run id on any number of parent replicas converge on one
child turn. Answers go back as events on the run's subject; a command that cannot be
parsed at all is kept as a dead letter.
"""

import asyncio
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tether.agent_registry import AgentRegistry
from tether.contract.messages import CancelSignal, ChatMessage, MessageSignal
from tether.domain import decide
from tether.domain.chat import ChatKey, chat_of, chat_of_new_run
from tether.domain.commands import (
    CancelCommand,
    ClearCommand,
    ContinueCommand,
    DeliveredCommand,
    MessageCommand,
    SendCommand,
    parse_command,
)
from tether.domain.decide import delivery_entry_of_report, record_delivery_of_this_life
from tether.domain.delivery_batches import batch_of
from tether.domain.events import Event, ParentRef
from tether.domain.fold import fold
from tether.domain.ids import names_this_life, user_message_id
from tether.domain.run_state import RunState
from tether.parent.command_parsing import Payload, UnparseableCommand, explain, json_object
from tether.parent.run_requests import RunRequests
from tether.parent.slots import SlotKeeper
from tether.ports import SYSTEM_CLOCK, Clock, EventLog
from tether.run_tree import TreeCancel, cancel_tree, cancels_below, descendants

if TYPE_CHECKING:
    from tether.delivery.deliverer import Deliverer


class CommandHandlers(RunRequests):
    """The parent's command handlers: `run` (`RunRequests`), and cancel, continue, send,
    message, delivered and clear."""

    def __init__(self, log: EventLog, agents: AgentRegistry, *, budgets: decide.Budgets,
                 slots: SlotKeeper | None, default_cap: int | None, max_input_bytes: int,
                 hook_registered, deliverer: "Deliverer | None" = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """`deliverer`: delivers the hooks of the outcomes these handlers append (a
        cancel's); None where nothing is to be delivered (tests of the decisions).
        `clock`: the time of the causes of what they decide."""
        super().__init__(log, agents, budgets=budgets, slots=slots, default_cap=default_cap,
                         max_input_bytes=max_input_bytes, hook_registered=hook_registered,
                         clock=clock)
        self._deliverer = deliverer

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
        state, appended = await self._log.recent.update(
            parent, run_id, partial(decide.resume, command=command, cause=cause))
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
            parent, run_id, partial(decide.send_message, command=command, cause=cause))
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
        ("appended") or, for several, each word and how many had it ("appended x3").
        Several whose hook ids name their runs' lives are one `deliveries.recorded` on the
        parent agent's ledger ("batched x<n>"); any other is recorded on its run."""
        command = self._parse(DeliveredCommand, "delivered", payload)
        reports = command.reports()
        if len(reports) == 1:
            return await self._record_delivery(command)
        batch, others = batch_of(reports, now=self._clock.now())
        results: Counter[str] = Counter()
        if batch is not None:
            await self._log.record_deliveries(batch)
            results["batched"] = len(batch.entries)
        # Each report is a fact of its own run, so they land side by side.
        results.update(await asyncio.gather(*map(self._record_delivery, others)))
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
            partial(record_delivery_of_this_life, command=command, now=self._clock.now()))
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
            command = parse_command(kind, json_object(payload))
        except (ValidationError, ValueError) as error:
            raise UnparseableCommand(f"invalid {kind} command: {explain(error)}") from None
        assert isinstance(command, model)
        return command


def _clear_life(incarnation: str, cause: decide.Cause) -> Callable[[RunState | None], list[Event]]:
    """Clear the run if it is still the life the clear matched."""
    def clear(state: RunState | None) -> list[Event]:
        if state is None or state.incarnation != incarnation:
            return []
        return decide.clear(state, cause)
    return clear
