"""Properties of the run fold over generated event histories of one run.

The projections store `RunState` as JSON and the projector may see an event twice, so the
fold must be deterministic, resumable from a (JSON) snapshot and indifferent to
duplicates; and a hard terminal status is final.
"""

import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.contract.codec import decode_event, encode_event
from tether.domain.branch_events import RunRewound
from tether.domain.budget_events import RunBudgetReleased, RunBudgetReserved, RunUsageCharged
from tether.domain.event_envelope import EventEnvelope
from tether.domain.events import (
    EVENT_CLASSES,
    HARD_TERMINAL,
    ParentRef,
    RunAborted,
    RunCancelRequested,
    RunCleared,
    RunCompleted,
    RunFailed,
    RunFinishDelivered,
    RunInterrupted,
    RunMilestone,
    RunNotified,
    RunOutput,
    RunPaused,
    RunProgressPersisted,
    RunReattachDecided,
    RunReattachStarted,
    RunRejected,
    RunRequested,
    RunResumed,
    RunRunning,
    RunStarted,
    RunStepRecorded,
)
from tether.domain.fold import evolve, fold
from tether.domain.run_state import RunState, state_from_json, state_json
from tether.domain.steering_events import RunMessageConsumed, RunMessageDelivered, RunMessageSent
from tether.domain.turn_events import RunTurnRequested

RUN_ID = "r1"
PARENT = ParentRef(agent="Assistant", name="user-42")
T0 = 1_700_000_000_000

PROPERTY = settings(max_examples=200, deadline=None)


def variants(**choices: list[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Every combination of the given field values, drawn in one choice (cheap to generate)."""
    names = list(choices)
    return st.sampled_from([dict(zip(names, values, strict=True))
                            for values in itertools.product(*choices.values())])


SMALL_JSON = [None, 3, {"sources": 2}, {"rows": [1, 2], "ok": True}]
FRACTIONS = [None, 0.0, 1 / 3, 1.0]
TEXTS = [None, "", "3 of 6 sources"]
# Mostly the next key in order (0); sometimes a repeated (< 0) or skipped (> 0) one.
key_offsets = st.sampled_from([0, 0, 0, -2, -1, 1, 2])
elapsed_ms = st.sampled_from([0, 1, 250, 5_000])

request_data = st.one_of(
    variants(agent_type=["Researcher"], input=[{"query": "HTTP/3"}, {}],
             parent_tool_call_id=[None, "call-1"], detached=[None],
             nested_parent=["run-1:tree"]),
    variants(agent_type=["Researcher"], input=[{"query": "HTTP/3"}],
             max_tokens=[None, 1_000], max_cost=[None, 0.5], nested_parent=["run-1:tree"],
             budgets_above=[[], [{"parent": {"agent": "Planner", "name": "p"},
                                  "run_id": "root"}]]),
    variants(agent_type=["Researcher"], input=[{"query": "gRPC"}],
             detached=[{"on_finish": "on_done", "notify": True, "on_milestones": ["drafted"]},
                       {"notify": {"source": "agent-tool"}}],
             max_budget_ms=[None, 1, 3_600_000], no_progress_budget_ms=[0, 1_000, 60_000],
             nested_parent=["run-1:tree"]),
    variants(agent_type=["Researcher"], input=[{"query": "HTTP/3, again"}],
             nested_parent=["run-1:tree"],
             fork=[{"run": {"parent": {"agent": "Assistant", "name": "user-42"},
                            "run_id": "original"},
                    "seq": 17, "at": "step:2",
                    "steps": [{"index": 0, "step": {"tool": "search"}},
                              {"index": 1, "step": {"tool": "fetch"}}],
                    "milestones": [{"sequence": 0, "name": "drafted", "at": T0 - 5}],
                    "output": [{"index": 0, "text": "HTTP/3 "}],
                    "resumptions": [{"pause_id": "p0", "decisions": {}, "at": T0 - 9}],
                    "overrides": {"instructions": "be brief"}}]),
)

LATEST_PAUSE, EARLIER_PAUSE = "<latest pause>", "<earlier pause>"
# Runs below the run, as the budget events name them.
BELOW = [{"parent": {"agent": "Researcher", "name": "r1:tree"}, "run_id": f"c{n}"}
         for n in (1, 2)]

# event class -> (name of its per-run key or None, strategy for the rest of its data): one
# entry per class of the domain (a new event class fails here until it has one).
EVENT_DATA: dict[type[EventEnvelope], tuple[str | None, st.SearchStrategy[dict]]] = {
    RunRequested: (None, request_data),
    RunTurnRequested: ("turn", variants(input=[{"query": "and gRPC?"}],
                                        parent_tool_call_id=[None, "call-2"],
                                        max_budget_ms=[None, 60_000])),
    RunRewound: (None, variants(error=["boom"], steps=[0, 2], max_budget_ms=[None, 60_000])),
    RunRejected: (None, variants(agent_type=["Researcher"], code=["cap"],
                                 error=["too many runs"])),
    RunStarted: (None, variants(work_subject=["tether.work.Researcher"])),
    RunRunning: ("attempt", variants(runner_id=["runner-a", "runner-b"])),
    RunOutput: ("index", variants(text=["", "HTTP/3 ", "QUIC"])),
    RunMilestone: ("sequence", variants(
        name=["sources-gathered", "drafted"], data=SMALL_JSON, fraction=FRACTIONS,
        message=TEXTS, phase=[None, "search"])),
    RunProgressPersisted: (None, variants(
        fraction=FRACTIONS, message=TEXTS, phase=[None, "search"], data=SMALL_JSON)),
    RunStepRecorded: ("index", variants(step=[{"tool": "search"}, {"tool": "fetch"}])),
    RunPaused: (None, variants(reason=["waiting_for_human", "waiting_for_tools"],
                               pending=[[], [{"tool_call_id": "c1"}]])),
    RunResumed: (None, variants(decisions=[{}, {"c1": "approved"}],
                                pause_id=[LATEST_PAUSE, EARLIER_PAUSE, "no-such"])),
    RunMessageSent: (None, variants(message_id=["m1", "m2"], mode=["queue", "interrupt"],
                                    text=["stop searching", None], data=[None, {"k": 1}])),
    RunMessageDelivered: (None, variants(message_id=["m1", "m2", "m3"], attempt=[1, 2])),
    RunMessageConsumed: (None, variants(message_id=["m1", "m2", "m3"], attempt=[1, 2])),
    RunBudgetReserved: (None, variants(run=BELOW, tokens=[0, 500], cost=[0.0, 0.25])),
    RunUsageCharged: (None, variants(run=BELOW, step=[0, 1, 2], tokens=[0, 120],
                                     cost=[0.0, 0.01])),
    RunBudgetReleased: (None, variants(run=BELOW)),
    RunCancelRequested: (None, variants(reason=[None, "user"])),
    RunCompleted: (None, variants(summary=["", "done"], output=SMALL_JSON)),
    RunFailed: (None, variants(error=["boom"])),
    RunAborted: (None, variants(error=["aborted"], cause=["cancel", "give-up", "child"])),
    RunInterrupted: (None, variants(
        reason=["no-progress", "window-exceeded", "budget-exceeded"], error=["gave up"],
        child_still_running=[True, False])),
    RunFinishDelivered: (None, variants(
        status=["completed", "error", "aborted", "interrupted"], method=[None, "on_done"],
        message_id=["finish:r1"])),
    RunNotified: (None, variants(
        kind=["finish", "milestone"], key=["completed", "drafted"],
        mode=["notify", "narrate", "react"], message_id=["detached:r1"])),
    RunReattachStarted: ("attempt", variants(cause=["parent-restart"])),
    RunReattachDecided: (None, variants(
        decision_id=["d1", "d2", "d3"], outcome=["finished", "reattached", "interrupted"],
        reason=[None, "no-progress"], child_still_running=[True, False],
        timings=[{}, {"inspect_ms": 12}])),
    RunCleared: (None, variants(reason=[None, "retention"])),
}
# kind (the event's type without "run.") -> (event class, per-run key, data strategy)
EVENT_KINDS = {cls.type.removeprefix("run."): (cls, *EVENT_DATA[cls]) for cls in EVENT_CLASSES}
ENDINGS = ["completed", "failed", "aborted", "interrupted"]


def test_the_histories_draw_every_event_class_of_the_domain():
    assert set(EVENT_DATA) == set(EVENT_CLASSES)
    assert set(ENDINGS) <= set(EVENT_KINDS)


FIRST_KEY = {"attempt": 1, "index": 0, "sequence": 0, "turn": 2}
STEP_OF_KIND = {kind: st.tuples(st.just(kind), data, key_offsets, elapsed_ms)
                for kind, (_, _, data) in EVENT_KINDS.items()}


def _steps(kinds: list[str]) -> st.SearchStrategy[list[tuple[str, dict, int, int]]]:
    """(kind, data without its key, key offset, ms since the previous event) per event."""
    one = st.sampled_from(kinds).flatmap(STEP_OF_KIND.__getitem__)
    return st.lists(one, min_size=3, max_size=30)


@st.composite
def run_histories(draw: Any, *, with_clears: bool = False) -> list[Any]:
    """A run.requested, then a random mix of a few event types for the same run.

    Per-run keys (attempts, output and step indexes, milestone sequences) mostly take the
    lowest one not used yet, so a skipped key is usually filled in later, but are sometimes
    repeated or skip ahead; times never go backwards; event ids are unique.
    """
    kinds = [kind for kind in EVENT_KINDS if with_clears or kind != "cleared"]
    # Each history uses a few event types only ("swarm testing"), so interplays between
    # two types (a resume before its pause, a chunk after a gap) come up often; half of
    # them get one way of ending the run on top, so what follows an ending comes up too.
    kinds = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4, unique=True))
    if draw(st.booleans()):
        kinds.append(draw(st.sampled_from(ENDINGS)))
    steps = [("requested", draw(request_data), 0, 0), *draw(_steps(kinds))]
    clock = T0
    used_keys: dict[str, set[int]] = {}
    events = []
    causes = _Causes(follow_ups="turn_requested" in kinds or "rewound" in kinds)
    for position, (kind, data, offset, elapsed) in enumerate(steps):
        event_cls, key, _ = EVENT_KINDS[kind]
        data = causes.caused(kind, dict(data), position, offset)
        if data is None:
            continue
        if key is not None and kind != "turn_requested":
            used = used_keys.setdefault(kind, set())
            expected = min(set(range(FIRST_KEY[key], FIRST_KEY[key] + len(used) + 1)) - used)
            data[key] = max(FIRST_KEY[key], expected + offset)
            used.add(data[key])
        clock += elapsed
        events.append(msgspec.convert({
            "event_id": f"e{position}", "run_id": RUN_ID, "parent": PARENT,
            "occurred_at": clock, "data": data,
        }, event_cls))
    return events


class _Causes:
    """What makes an event possible at its place in a history: a resume names a pause
    there is, a receipt a message sent, a follow-up the next turn of a run that ended; a
    turn's second outcome is never appended (`decide.finish_attempt`: a later turn would
    take it for its own)."""

    def __init__(self, *, follow_ups: bool) -> None:
        self.follow_ups = follow_ups
        self.pauses: list[str] = []
        self.sent: list[str] = []
        self.ended = False  # the current turn's hard outcome is in
        self.failed = False  # ... and it was a failure
        self.turn = 1

    def caused(self, kind: str, data: dict, position: int, offset: int) -> dict | None:
        """The event's data as its causes make it; None: the event is not appended."""
        if kind in ("completed", "failed", "aborted"):
            if self.ended and self.follow_ups:
                return None
            self.ended, self.failed = True, kind == "failed"
        elif kind == "rewound":
            if not (self.ended and self.failed):
                return None  # (a rewind is of a failed run: the parent decides it so)
            self.ended = False
        elif kind == "turn_requested":
            if self.ended and offset >= 0:
                self.turn, self.ended = self.turn + 1, False
            elif self.turn < 2:
                return None  # (else it repeats the turn the run is at)
            data["turn"] = self.turn
        elif kind == "paused":
            self.pauses.append(f"e{position}")
        elif kind == "resumed":
            data["pause_id"] = _pause_named(data["pause_id"], self.pauses)
        elif kind == "message_sent":
            self.sent.append(data["message_id"])
        elif kind in ("message_delivered", "message_consumed") and (
                data["message_id"] not in self.sent):
            data["message_id"] = "never-sent"
        return data


def _pause_named(choice: str, pauses: list[str]) -> str:
    if choice == LATEST_PAUSE and pauses:
        return pauses[-1]
    if choice == EARLIER_PAUSE and len(pauses) > 1:
        return pauses[-2]
    return "no-such"


def states_after_each(events: list[Any]) -> list[RunState | None]:
    """states[k] is the state after the first k events."""
    states: list[RunState | None] = [None]
    for event in events:
        states.append(evolve(states[-1], event).state)
    return states


def through_json(state: RunState | None) -> RunState | None:
    return None if state is None else state_from_json(state_json(state))


@PROPERTY
@given(run_histories())
def test_folding_is_deterministic_and_replaying_the_log_again_changes_nothing(
    events: list[Any],
) -> None:
    once = fold(events)

    assert fold(events) == once
    assert fold([decode_event(encode_event(event)) for event in events]) == once
    for end in range(1, len(events) + 1):
        prefix = events[:end]
        # (within a turn: see `_turn_of`)
        again = [event for event in prefix if _turn_of(prefix, event) == _turn_of(prefix)]
        assert fold(prefix + again) == fold(prefix), f"replaying the first {end} events again"


def _turn_of(events: list[Any], event: Any = None) -> int:
    """How many follow-up turns and rewinds (lives) the run had taken when `event` was appended (None: after
    the last). An event of an earlier turn is never appended again once a later one
    began: every writer decides from the run as it is, and a later turn is another life
    of the run (`RunState.incarnation`) whose decisions refuse the earlier one's."""
    position = len(events) if event is None else events.index(event)
    return sum(1 for e in events[:position] if e.type in ("run.turn_requested", "run.rewound"))


@PROPERTY
@given(run_histories())
def test_snapshot_plus_the_remaining_events_equals_a_full_replay(events: list[Any]) -> None:
    full = fold(events)

    for split, snapshot in enumerate(states_after_each(events)):
        assert fold(events[split:], snapshot) == full
        assert fold(events[split:], through_json(snapshot)) == full, f"snapshot after {split}"


@PROPERTY
@given(run_histories(), st.data())
def test_a_duplicate_of_any_event_changes_nothing(events: list[Any], data: st.DataObject) -> None:
    full = fold(events)
    states = states_after_each(events)

    for original in range(len(events)):
        # Seen again right after itself, or after any later event: states[later] is the
        # state at that point, and an unchanged state leaves the rest of the fold unchanged.
        for later in range(original + 1, len(events) + 1):
            if _turn_of(events[:later]) != _turn_of(events, events[original]):
                break  # (a later turn: see `_turn_of`)
            again = evolve(states[later], events[original])
            assert again.state == states[later], (original, later, again.note)

    original = data.draw(st.integers(0, len(events) - 1), label="duplicated event")
    later = data.draw(st.integers(original + 1, len(events)), label="inserted before position")
    if _turn_of(events[:later]) == _turn_of(events, events[original]):
        with_duplicate = [*events[:later], events[original], *events[later:]]
        assert fold(with_duplicate) == full


@PROPERTY
@given(run_histories(with_clears=True))
def test_a_hard_terminal_status_never_changes_until_the_run_is_cleared(events: list[Any]) -> None:
    """(or until it takes a follow-up turn or is rewound, which starts it again)"""
    final: str | None = None
    before = None
    for event, state in zip(events, states_after_each(events)[1:], strict=True):
        if isinstance(event, RunCleared) or (
                state is not None and before is not None
                and (state.turn, state.rewinds) > (before.turn, before.rewinds)):
            final = None
        elif final is not None:
            assert state is not None and state.status == final, (event.type, final)
        elif state is not None and state.status in HARD_TERMINAL:
            final = state.status
        before = state
