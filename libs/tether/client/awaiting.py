"""When a run request has its answer, decided from the run's events alone.

The client subscribes to the run's live subject (where the events stream republishes each
event once stored), publishes the request, and feeds every event to a `RunWaiter` once, in
stream order (`RunFold`). The *mark* is where the run's subject ended before the request:
0 for a new run id, whose first event arrives live with nothing before it; otherwise the
previous sequence of the first live event, the sequence in the parent's notice that the
run was already there, or the end of a read made before the request is published again
(client/placing.py, `RunRequest`). Anything at or below the mark happened before this
request: a stored outcome there is the answer (a repeated run id never starts a second
child turn), but a rejection or an interruption there answered someone else's earlier
request. Nothing is decided before the replay has reached the mark, so a run that was
cleared and is requested again is never answered from its previous life.

If the server dropped the request as a repeat of one still in its duplicate window, no
parent will act on it: an open run is awaited, a run that does not exist yet is awaited
(the request it repeated is in flight: for a run id whose last event was a rejection or a
clear, the request's id names that event, so it repeated one made after it), and an
interrupted run that is not being re-attached is answered with its interruption, since
nobody is going to re-attach it for us.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pydantic_core

from tether.contract.codec import EventDecodeError, brief_reason
from tether.contract.messages import AgentToolFailure, AgentToolSuccess, DetachedHandle
from tether.domain.commands import RunCommand
from tether.domain.decide import taken_by_another
from tether.domain.events import (
    Event,
    RunCleared,
    RunInterrupted,
    RunReattachStarted,
    RunRejected,
    RunRequested,
)
from tether.domain.fold import evolve
from tether.domain.run_state import RunState, TurnRecord
from tether.domain.spending import BUDGET_EXCEEDED

if TYPE_CHECKING:
    from tether.ports import StoredEvent

Answer = AgentToolSuccess | AgentToolFailure | DetachedHandle


@dataclass(slots=True)
class _Rejection:
    seq: int
    error: str
    code: str = ""


class RunWaiter:
    def __init__(self, run_id: str, agent_type: str, *, mark: int, detached: bool,
                 turn: int | None = None, rewind: int | None = None,
                 request: RunCommand | None = None) -> None:
        """`turn`: a follow-up's turn, answered by that turn's outcome (None: the run's).
        `rewind`: a rewind's number, answered by the outcome of the run once rewound so.
        `request`: the request, checked against the run its id names: one that is not a
        repeat of it is answered with why (`decide.taken_by_another`)."""
        self.run_id = run_id
        self.request = request
        self._repeat_checked = request is None
        self.agent_type = agent_type
        self.mark = mark
        self.detached = detached
        self.turn = turn
        self.rewind = rewind
        self.state: RunState | None = None
        self.answer: Answer | None = None
        self._caught_up = mark == 0
        self._duplicate = False
        self._rejection: _Rejection | None = None
        self._interrupted_seq = 0
        self._reattaching = False
        self._cleared_after_mark = False

    @property
    def caught_up(self) -> bool:
        return self._caught_up

    @property
    def taken(self) -> bool:
        """Whether a parent has acted on the request, as far as the run's events show: it
        answered it, or the run has begun the turn or the rewind it asks for. (A plain
        request or a fork is taken once its run is in the log at all: `RunRequest`.)"""
        state = self.state
        if self.answer is not None or (self.turn is None and self.rewind is None):
            return True
        if state is None:
            return False
        if self.turn is not None:
            return state.turn >= self.turn
        assert self.rewind is not None
        return state.rewinds >= self.rewind

    def on_event(self, seq: int, event: Event | None, pending: int = 1) -> Answer | None:
        """Fold one message of the run's subject (None: undecodable, only moves the position)."""
        if event is not None and event.run_id == self.run_id:
            self._fold(seq, event)
        if seq >= self.mark or pending == 0:
            self._caught_up = True
        return self._decide()

    def on_published(self, duplicate: bool) -> Answer | None:
        self._duplicate = duplicate
        return self._decide()

    def _fold(self, seq: int, event: Event) -> None:
        if isinstance(event, RunRejected):
            self._rejection = _Rejection(seq, event.data.error, event.data.code)
            return
        if isinstance(event, RunRequested):
            self._repeat_checked = self.request is None
            self._rejection = None
            self._interrupted_seq = 0
            self._reattaching = False
            self._cleared_after_mark = False
        elif isinstance(event, RunInterrupted):
            self._interrupted_seq = seq
            self._reattaching = False
        elif isinstance(event, RunReattachStarted):
            self._reattaching = True
        elif isinstance(event, RunCleared) and self.state is not None and seq > self.mark:
            self._cleared_after_mark = True
        self.state = evolve(self.state, event).state

    def _decide(self) -> Answer | None:
        if self.answer is None and self._caught_up:
            if (taken := self._taken()) is not None:
                self.answer = taken
            elif (self.turn is not None and (answer := self._other_turn()) is not False) or (self.rewind is not None and (answer := self._before_rewind()) is not False):
                self.answer = answer
            else:
                self.answer = self._detached() if self.detached else self._awaited()
        return self.answer

    def _taken(self) -> Answer | None:
        """The answer to a request whose run id names another request's run (once per
        life of the run id: its `run.requested`)."""
        request, state = self.request, self.state
        if self._repeat_checked or request is None or state is None:
            return None
        self._repeat_checked = True
        why = taken_by_another(state, request)
        if why is not None and (sent := json_input(request.input)) != request.input:
            # compared as the parent got it (tuples as lists, dates as text, ...)
            why = taken_by_another(state, request.model_copy(update={"input": sent}))
        if why is None:
            return None
        if self.detached:
            return DetachedHandle(run_id=self.run_id, agent_type=self.agent_type,
                                  status="error", error=why)
        return AgentToolFailure(run_id=self.run_id, agent_type=self.agent_type,
                                status="error", error=why, retryable=False)

    def _other_turn(self) -> Answer | Literal[False] | None:
        """A follow-up's answer while the run is at another turn than it asked for: None
        while the run has not begun it (unless it was refused), that turn's outcome once
        the run went past it; False when the run is at the turn (answered as a run)."""
        state, turn = self.state, self.turn
        assert turn is not None
        if state is not None and state.turn == turn:
            return False
        if state is None or state.turn < turn:
            return self._refused()
        finished = turn_outcome(state, state.turns[turn - 1])
        if self.detached:
            return DetachedHandle(run_id=self.run_id, agent_type=state.agent_type,
                                  status=finished.status if not finished.ok else "completed",
                                  result=finished)
        return finished

    def _before_rewind(self) -> Answer | Literal[False] | None:
        """A rewind's answer while the run has not been rewound so yet: None (it waits for
        the parent), or the parent's refusal; False once it has (answered as a run)."""
        state, rewind = self.state, self.rewind
        assert rewind is not None
        if state is not None and state.rewinds >= rewind:
            return False
        return self._refused()

    def _refused(self) -> Answer | None:
        """The parent's refusal of a follow-up or a rewind, as its caller gets it (None:
        none yet)."""
        rejection = self._answering_rejection()
        if rejection is None:
            return None
        if self.detached:
            return DetachedHandle(run_id=self.run_id, agent_type=self.agent_type,
                                  status="error", error=rejection.error)
        reason = "budget-exceeded" if rejection.code == BUDGET_EXCEEDED else None
        return AgentToolFailure(run_id=self.run_id, agent_type=self.agent_type,
                                status="error", error=rejection.error, retryable=False,
                                reason=reason)

    def _detached(self) -> Answer | None:
        state = self.state
        if state is not None and (state.is_hard_terminal or (state.status == "interrupted"
                                  and not state.resumable)):
            # Requested again after it ended (or was given up for good): its stored
            # outcome, at once.
            result = stored_outcome(state)
            return DetachedHandle(run_id=self.run_id, agent_type=state.agent_type,
                                  status=state.status, result=result,
                                  error=getattr(result, "error", None))
        if state is not None:
            return DetachedHandle(run_id=self.run_id, agent_type=state.agent_type,
                                  status="running")
        rejection = self._answering_rejection()
        if rejection is not None:
            return DetachedHandle(run_id=self.run_id, agent_type=self.agent_type,
                                  status="error", error=rejection.error)
        return None

    def _awaited(self) -> Answer | None:
        state = self.state
        if state is None:
            if self._cleared_after_mark:
                return AgentToolFailure(run_id=self.run_id, agent_type=self.agent_type,
                                        status="aborted", error="the run was cleared",
                                        retryable=False)
            rejection = self._answering_rejection()
            if rejection is None:
                return None
            # A budget that had no room for it: the reason a model parent can act on.
            reason = "budget-exceeded" if rejection.code == BUDGET_EXCEEDED else None
            return AgentToolFailure(run_id=self.run_id, agent_type=self.agent_type,
                                    status="error", error=rejection.error, retryable=False,
                                    reason=reason)
        if state.is_hard_terminal:
            return stored_outcome(state)
        if state.status == "interrupted":
            if self._interrupted_seq > self.mark or not state.resumable:
                return AgentToolFailure.of(state)
            if self._duplicate and not self._reattaching:
                return AgentToolFailure.of(state)
        return None

    def _answering_rejection(self) -> _Rejection | None:
        """A rejection that answers our request, or the one it repeated: one after the mark.
        One at or before it answered an earlier request, which did not claim the run id."""
        rejection = self._rejection
        if rejection is None or rejection.seq <= self.mark:
            return None
        return rejection


def stored_outcome(state: RunState) -> AgentToolSuccess | AgentToolFailure:
    """The outcome of a run that ended (completed, error, aborted, or interrupted for
    good), as its caller gets it.
    A child that streamed text and returned no structured output: its text is the output,
    so a caller gets what the timeline shows."""
    if state.status == "completed":
        output = state.output if state.output is not None else (state.output_text or None)
        return AgentToolSuccess(run_id=state.run_id, agent_type=state.agent_type,
                                summary=state.summary or "", output=output)
    return AgentToolFailure.of(state)


def turn_outcome(state: RunState, turn: TurnRecord) -> AgentToolSuccess | AgentToolFailure:
    """The outcome of a finished turn of a run that took a follow-up since."""
    if turn.status == "completed":
        return AgentToolSuccess(run_id=state.run_id, agent_type=state.agent_type,
                                summary=turn.summary or "", output=turn.output)
    status = turn.status if turn.status in ("error", "aborted", "interrupted") else "error"
    return AgentToolFailure(run_id=state.run_id, agent_type=state.agent_type, status=status,
                            error=turn.error or turn.status, retryable=False,
                            reason=turn.reason)


@dataclass(frozen=True, slots=True)
class LiveEvent:
    """A run event as the stream republished it: its stream sequence, and the sequence of
    the run's message before it (`Nats-Last-Sequence`; 0 when it was the first); `error`
    says why `event` is None."""

    seq: int
    previous_seq: int
    event: Event | None
    error: EventDecodeError | None = None


@dataclass(frozen=True, slots=True)
class UnreadableMessage:
    """A message of the run's subject this client cannot decode (an event of a newer
    Tether, or a damaged one), skipped by the fold: its stream sequence, and why."""

    seq: int
    reason: str

    @classmethod
    def of(cls, seq: int, error: EventDecodeError | None) -> "UnreadableMessage":
        return cls(seq, brief_reason(str(error)) if error is not None else "not an event")


class RunFold:
    """The run's messages folded into a `RunWaiter` once each, in stream order.

    They come from two overlapping sources: reads of the stream and the live messages the
    stream republishes. The stream sequence is the key: a message at or below the last one
    folded is skipped. Live delivery is at most once (core NATS drops messages for a slow
    consumer or across a reconnect), so a live message whose predecessor on the run's
    subject was never folded says something was lost: `missed_before` asks the caller to
    read the stream from `last_seq + 1` before folding it.
    """

    def __init__(self, waiter: RunWaiter) -> None:
        self.waiter = waiter
        self.last_seq = 0
        # The messages folded that did not decode, in order: the caller is told of each,
        # since one of them may be the answer it waits for (`placing.Undecodable`).
        self.unreadable: list[UnreadableMessage] = []

    def fold(self, seq: int, event: Event | None, pending: int = 1,
             error: EventDecodeError | None = None) -> Answer | None:
        """One message; `event` None (with its decode `error`) only moves the position."""
        if seq > self.last_seq:
            self.last_seq = seq
            if event is None:
                self.unreadable.append(UnreadableMessage.of(seq, error))
            return self.waiter.on_event(seq, event, pending)
        return self.waiter.answer

    def fold_read(self, stored: Sequence["StoredEvent"]) -> Answer | None:
        """Messages read from the stream; the last was the end of the subject when read."""
        answer = self.waiter.answer
        for index, message in enumerate(stored):
            answer = self.fold(message.seq, message.event,
                               pending=0 if index == len(stored) - 1 else 1,
                               error=message.error)
        return answer

    @property
    def last_unreadable(self) -> UnreadableMessage | None:
        """The last message folded, when it did not decode."""
        last = self.unreadable[-1] if self.unreadable else None
        return last if last is not None and last.seq == self.last_seq else None

    def missed_before(self, live: LiveEvent) -> bool:
        return live.previous_seq > self.last_seq


def json_input(value: dict[str, Any]) -> Any:
    """A run's input as the parent reads it from the request's JSON."""
    return json.loads(pydantic_core.to_json(value))
