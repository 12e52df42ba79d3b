"""The chaos scenarios' checks on what happened to each run, from the log and the
services' log lines. Each returns the problems it found, as sentences that name the run,
the event, the process and the times, so that a failing scenario says what went wrong.

Times are compared on one clock, the test's: an event's time is when the broker stored
it (its `Nats-Time-Stamp`; the broker runs on this host, unskewed), and a service's log
line's time is its timestamp less that service's measured clock offset
(`ServiceProcess.clock_offset_s`), so a service started with a skewed clock is judged
by when things really happened.
"""

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from tether.domain.events import Event

OUTCOMES = ("run.completed", "run.failed", "run.aborted", "run.interrupted")
# What moves a run's no-progress deadline (`fold._with_signal`), and its start.
SIGNALS = ("run.requested", "run.running", "run.milestone", "run.progress_persisted",
           "run.resumed")
# How far apart two clocks' readings of one instant may be after the offset correction
# (a line is read some milliseconds after it is written; the offset is measured).
CLOCK_TOLERANCE_S = 0.5


@dataclass(frozen=True)
class Appended:
    """An event of the log and when the broker stored it (the test's clock)."""

    seq: int
    event: Event
    at: float


@dataclass(frozen=True)
class TurnStart:
    """A `chaos.turn_started` line of a child-runner, on the test's clock."""

    run_id: str
    attempt: int
    at: float
    runner: str


@dataclass(frozen=True)
class ServiceLine:
    """One log line of a service, its time on the test's clock."""

    service: str  # "reconciler pid 1234"
    event: str
    at: float
    line: dict


@dataclass(frozen=True)
class Pause:
    """A process the scenario stopped (SIGSTOP) and continued (SIGCONT), test's clock."""

    target: str  # "reconciler pid 1234", "nats-server", "postgres"
    stopped_at: float
    continued_at: float


def clock(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def _describe(appended: Appended) -> str:
    return (f"{appended.event.type} (seq {appended.seq}, stored {clock(appended.at)}, "
            f"occurred_at {clock(appended.event.occurred_at / 1000)}, "
            f"caused by {appended.event.causation_id})")


def outcome_problems(histories: dict[str, list[Appended]]) -> list[str]:
    """Exactly one outcome event per run."""
    problems = []
    for run_id, history in sorted(histories.items()):
        outcomes = [a for a in history if a.event.type in OUTCOMES]
        if len(outcomes) != 1:
            problems.append(f"run {run_id} has {len(outcomes)} outcome events, not one: "
                            + ("; ".join(map(_describe, outcomes)) or "none"))
    return problems


def turn_problems(histories: dict[str, list[Appended]], turns: Iterable[TurnStart], *,
                  runner_lost: bool) -> list[str]:
    """No child turn started for an attempt the log does not hold, after a newer attempt
    took the run over, or after the run's outcome; and one turn per `run.running` (at
    most one, when a runner was lost between its `run.running` and the child's start:
    killed, or paused past its hold, when it wakes to an attempt taken over and starts
    nothing)."""
    by_run: dict[str, list[TurnStart]] = defaultdict(list)
    for turn in turns:
        by_run[turn.run_id].append(turn)
    problems = []
    for run_id, history in sorted(histories.items()):
        running = [a for a in history if a.event.type == "run.running"]
        attempts = {a.event.data.attempt: a for a in running}  # type: ignore[union-attr]
        outcome = next((a for a in history if a.event.type in OUTCOMES), None)
        started = sorted(by_run.pop(run_id, []), key=lambda t: t.at)
        for turn in started:
            where = f"attempt {turn.attempt}'s child turn started at {clock(turn.at)} on {turn.runner}"
            if turn.attempt not in attempts:
                problems.append(f"run {run_id}: {where}, but the log has no run.running for "
                                f"that attempt (its attempts: {sorted(attempts)})")
            newer = [a for n, a in attempts.items()
                     if n > turn.attempt and a.at + CLOCK_TOLERANCE_S < turn.at]
            if newer:
                problems.append(f"run {run_id}: {where}, after attempt "
                                f"{newer[0].event.data.attempt} had taken the run over: "  # type: ignore[union-attr]
                                f"{_describe(newer[0])}")
            if outcome is not None and outcome.at + CLOCK_TOLERANCE_S < turn.at:
                problems.append(f"run {run_id}: {where}, after the run had ended: "
                                f"{_describe(outcome)}")
        too_many = len(started) > len(running)
        if too_many or (len(started) < len(running) and not runner_lost):
            problems.append(
                f"run {run_id}: {len(started)} child turns started "
                f"({', '.join(f'attempt {t.attempt} at {clock(t.at)} on {t.runner}' for t in started) or 'none'}) "
                f"for {len(running)} run.running events "
                f"({', '.join(_describe(a) + f' attempt {a.event.data.attempt}' for a in running) or 'none'})")  # type: ignore[union-attr]
    for run_id, started in sorted(by_run.items()):
        problems.append(f"run {run_id}: child turns started for a run the log does not hold: "
                        f"{started}")
    return problems


def no_progress_problems(histories: dict[str, list[Appended]]) -> list[str]:
    """No run given up for silence while its silences (gaps between progress signals, as
    the broker stored them) stayed under its no-progress budget."""
    problems = []
    for run_id, history in sorted(histories.items()):
        requested = next((a for a in history if a.event.type == "run.requested"), None)
        for interrupted in history:
            if interrupted.event.type != "run.interrupted" \
                    or interrupted.event.data.reason != "no-progress":  # type: ignore[union-attr]
                continue
            budget_s = (requested.event.data.no_progress_budget_ms / 1000  # type: ignore[union-attr]
                        if requested is not None else 0)
            signals = [a for a in history
                       if a.event.type in SIGNALS and a.at <= interrupted.at]
            moments = [*(a.at for a in signals), interrupted.at]
            longest = max((b - a for a, b in itertools.pairwise(moments)),
                          default=0.0)
            if signals and longest < budget_s:
                problems.append(
                    f"run {run_id} was interrupted no-progress by {_describe(interrupted)}, "
                    f"though its longest silence was {longest:.1f}s of its {budget_s:g}s "
                    f"budget ({len(signals)} signals, the last {_describe(signals[-1])})")
    return problems


# The log lines of a leader's actions: what it decided or tried to decide.
ACTIONS = {
    "reconciler": ("recovery.decided", "reconciler.decision_failed", "delivery.hook_published",
                   "delivery.recorded_by_handler", "agent_tool:"),
    "projector": ("projector.batch_retried", "projector.event_not_applied",
                  "projector.dead_lettered"),
}
LEASE_ENDS = ("leadership.lost", "leadership.released")


def stale_lease_problems(role: str, lines: dict[str, list[ServiceLine]],
                         pauses: Iterable[Pause],
                         appended: Iterable[Appended] = ()) -> list[str]:
    """No instance of `role` acted between waking from a pause during which another
    instance took the lease (a `leadership.acquired` of another between its SIGSTOP and
    its SIGCONT) and its own notice that the lease was gone.

    What it covers, and what not:
    - The lease's confirmations are not logged, so "before its next confirmation" is
      read as "before it logged `leadership.lost` or `leadership.released`".
    - From the log lines: an action line of the paused instance (`ACTIONS`: the
      reconciler's recovery decisions, deadline decisions that failed, finish hooks it
      published again, its operator events `agent_tool:*`; the projector's retried,
      skipped or dead-lettered batches) logged in that window. A projector's applied
      batches log no line, so its stale writes are not seen here (its checkpoint, written
      in the rows' transaction, keeps them harmless; `verify` checks the result).
    - From the log (reconciler only; the projector appends nothing): after the takeover,
      events decided by a reconciler's timer (causation `rec-<origin>:…`, the origin
      unique to each reconciler process) come from one origin only, the new leader's.
      The reconciler's origin is not logged, so an event is not tied to a process; two
      origins after the takeover mean the old leader decided after it was deposed.
      Decisions caused by a command (`cmd:…`) are not told apart.
    """
    problems = []
    for pause in pauses:
        if pause.target not in lines:
            continue
        takeovers = [line for other, own in lines.items() if other != pause.target
                     for line in own if line.event == "leadership.acquired"
                     and pause.stopped_at <= line.at <= pause.continued_at + CLOCK_TOLERANCE_S]
        if not takeovers:
            continue
        takeover = takeovers[0]
        after = [line for line in lines[pause.target] if line.at >= pause.continued_at]
        end = next((line for line in after if line.event in LEASE_ENDS), None)
        for line in after:
            if end is not None and line.at >= end.at:
                break
            if line.event.startswith(ACTIONS[role]):
                problems.append(
                    f"{pause.target} acted on a stale lease: {line.event} "
                    f"{line.line.get('run_id', '')} at {clock(line.at)}, after its pause "
                    f"(SIGSTOP {clock(pause.stopped_at)}, SIGCONT {clock(pause.continued_at)}) "
                    f"during which {takeover.service} took the lease ({clock(takeover.at)}), "
                    + (f"before it logged {end.event} at {clock(end.at)}" if end is not None
                       else "and it never logged the lease's loss"))
        if role == "reconciler":
            origins: dict[str, list[Appended]] = defaultdict(list)
            for event in appended:
                cause = event.event.causation_id or ""
                if cause.startswith("rec-") and event.at > takeover.at:
                    origins[cause.split(":", 1)[0]].append(event)
            if len(origins) > 1:
                problems.append(
                    f"after {takeover.service} took the lease at {clock(takeover.at)} (while "
                    f"{pause.target} was paused), {len(origins)} reconcilers decided: "
                    + "; ".join(f"{origin}: {len(events)} events, the first "
                                f"{events[0].event.run_id} {_describe(events[0])}"
                                for origin, events in sorted(origins.items())))
    return problems


def leadership_terms(lines: dict[str, list[ServiceLine]],
                     ended_at: dict[str, float], now: float) -> list[tuple[float, float, str]]:
    """Each instance's terms: from its `leadership.acquired` to its `leadership.released`
    (logged once it stopped acting), or to its process's end."""
    terms = []
    for service, own in lines.items():
        start = None
        for line in own:
            if line.event == "leadership.acquired":
                start = line.at
            elif line.event == "leadership.released" and start is not None:
                terms.append((start, line.at, service))
                start = None
        if start is not None:
            terms.append((start, ended_at.get(service, now), service))
    return sorted(terms)


def overlapping_terms(role: str, terms: list[tuple[float, float, str]],
                      pauses: Iterable[Pause]) -> list[str]:
    """No two instances held the lease at one moment, except while the older one was
    stopped (SIGSTOP) by the scenario: a stopped process does nothing, and what it did
    after waking up is `stale_lease_problems`' to judge."""
    stopped = list(pauses)
    problems = []
    for i, (_, end, who) in enumerate(terms):
        for start, _, other in terms[i + 1:]:
            if start >= end:
                continue
            if any(pause.target == who and pause.stopped_at <= start <= pause.continued_at
                   for pause in stopped):
                continue
            problems.append(f"{who} and {other} both led {role}: {other} acquired the lease "
                            f"at {clock(start)}, {who}'s term ended at {clock(end)}")
    return problems
