"""What a W1 must leave behind, checked after it from the events stream itself.

Throughput means nothing if replicas lose or repeat work, so after W1 the bench reads
every event of its runs back from the log, with the headers their appends carried, and
checks:

- `lost`: every accepted run is in the log, reached an outcome and had its finish hook
  handled by the application;
- `chain_broken`: each append that expected a sequence
  (`Nats-Expected-Last-Subject-Sequence`) landed right after the event it expected, the
  previous one on its run's subject (0 for the first);
- `fold_refused`: the fold applies every event in stream order (a duplicate, an event
  before its run or after its outcome is refused by `evolve` with a note);
- `fold_order`: the run starts with its `run.requested`, its milestones come in their
  sequence, and a finish hook is recorded delivered only after the outcome it reports;
- `duplicate_turn`: one child turn per run: a single `run.running`, with attempt 1, and
  at most one `run.started`;
- `hook_not_once`: the application's hook function ran once per run, and the run's
  ledger records one delivery of it for the run's outcome (appended to the run, or an
  entry of a batch on its parent agent's delivery ledger, which is read as the run's
  `run.finish_delivered` at the batch's place in the stream).

`check_w1` is pure, so a doctored history proves each check can fail
(tests/unit/test_bench_correctness.py).
"""

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from tether.adapters.event_log import EventLog
from tether.contract.subjects import is_delivery_ledger
from tether.domain.events import (
    HARD_TERMINAL,
    Event,
    RunFinishDelivered,
    RunMilestone,
    RunRequested,
    RunRunning,
    RunStarted,
)
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.ports import stored_events

EXPECTED_HEADER = "Nats-Expected-Last-Subject-Sequence"
CHECKS = ("lost", "chain_broken", "fold_refused", "fold_order", "duplicate_turn",
          "hook_not_once")
EXAMPLES = 5  # kept per check


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """One stored message of the events stream, as the check needs it."""

    seq: int
    subject: str
    expected_last_seq: int | None  # what its append expected; None: appended unconditionally
    event: Event | None  # None: it did not decode
    batched: bool = False  # an entry of a delivery ledger's batch, not on the run's subject


async def read_log(log: EventLog, filter_subject: str) -> list[LoggedEvent]:
    """Every stored event matching `filter_subject`, in stream order, by batched direct
    gets (no consumer), with the expected sequence their appends carried."""
    found: list[LoggedEvent] = []
    seq = 1
    while True:
        batch, pending = await log.read_stored(log.subjects.events_stream, filter_subject,
                                               start_seq=seq)
        for msg in batch:
            headers = msg.headers or {}
            expected = headers.get(EXPECTED_HEADER)
            subject = headers["Nats-Subject"]
            batched = is_delivery_ledger(subject)
            for stored in stored_events(int(headers["Nats-Sequence"]), subject, msg.data):
                found.append(LoggedEvent(stored.seq, stored.subject,
                                         None if expected is None else int(expected),
                                         stored.event, batched))
        if not batch or not pending:
            return found
        seq = found[-1].seq + 1


async def verify_w1(log: EventLog, *, accepted: Collection[str], hook_calls: Mapping[str, int],
                    hook_method: str, settle_s: float = 10.0) -> dict:
    """`check_w1` over the whole events stream. A run's ledger event lands a moment after
    its hook function returned, so a finding is checked again, twice a second, until
    `settle_s`: what the log holds only grows, and a real violation stays."""
    deadline = time.monotonic() + settle_s
    while True:
        logged = await read_log(log, log.subjects.all_events)
        verdict = check_w1(logged, accepted=accepted, hook_calls=hook_calls,
                           hook_method=hook_method)
        if verdict["ok"] or time.monotonic() > deadline:
            return verdict
        await asyncio.sleep(0.5)


class _Findings:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({check: 0 for check in CHECKS})
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, check: str, example: str) -> None:
        self.counts[check] += 1
        if len(self.examples[check]) < EXAMPLES:
            self.examples[check].append(example)


def check_w1(logged: Iterable[LoggedEvent], *, accepted: Collection[str],
             hook_calls: Mapping[str, int], hook_method: str) -> dict:
    """The checks above over the log's events of W1's runs (`accepted`: the run ids whose
    requests were accepted; `hook_calls`: how often the application's hook ran per run).

    Returns the count of violations per check, a few examples of each, `ok`, how many
    events' appends expected a sequence (`conditional_appends`: the material of
    `chain_broken`), and how many runs each child-runner began (`runners`, by
    `runner_id`)."""
    wanted = set(accepted)
    by_subject: dict[str, list[LoggedEvent]] = defaultdict(list)
    run_of: dict[str, str] = {}
    findings = _Findings()
    events = 0
    for item in logged:
        if item.event is None:
            findings.add("fold_refused", f"seq {item.seq} on {item.subject} did not decode")
            continue
        if item.event.run_id not in wanted:
            continue
        events += 1
        by_subject[item.subject].append(item)
        run_of[item.subject] = item.event.run_id
    runners: Counter[str] = Counter()
    seen: set[str] = set()
    for subject, items in by_subject.items():
        run_id = run_of[subject]
        seen.add(run_id)
        state = _check_run(run_id, items, findings, runners, hook_method)
        if state is None or state.status not in HARD_TERMINAL:
            findings.add("lost", f"{run_id}: no outcome in the log "
                                 f"(status {state.status if state else 'none'})")
    for run_id in sorted(wanted - seen):
        findings.add("lost", f"{run_id}: not in the log")
    for run_id in sorted(wanted):
        calls = hook_calls.get(run_id, 0)
        if calls == 0:
            findings.add("lost", f"{run_id}: its finish hook was never handled")
        elif calls > 1:
            findings.add("hook_not_once", f"{run_id}: the hook function ran {calls} times")
    conditional = sum(1 for items in by_subject.values() for item in items
                      if item.expected_last_seq is not None)
    return {"runs": len(wanted), "events": events, "conditional_appends": conditional,
            "ok": not any(findings.counts.values()),
            "violations": dict(findings.counts), "examples": dict(findings.examples),
            "runners": dict(runners)}


@dataclass
class _Run:
    """What one run's events showed so far."""

    run_id: str
    state: RunState | None = None
    previous_seq: int = 0
    running: int = 0
    started: int = 0
    delivered: Counter[str] = field(default_factory=Counter)  # hook deliveries by status


def _check_run(run_id: str, items: list[LoggedEvent], findings: _Findings,
               runners: Counter[str], hook_method: str) -> RunState | None:
    run = _Run(run_id)
    for item in items:
        assert item.event is not None
        _check_event(run, item, item.event, findings, runners, hook_method)
        evolved = evolve(run.state, item.event)
        if not evolved.applied:
            findings.add("fold_refused", f"{run_id}: {item.event.type} at seq {item.seq}: "
                                         f"{evolved.note or 'not applied'}")
        run.state = evolved.state
        if not item.batched:  # (a batch's entry is stored on its agent's ledger)
            run.previous_seq = item.seq
    if run.running > 1 or run.started > 1:
        findings.add("duplicate_turn", f"{run_id}: {run.running} run.running and "
                                       f"{run.started} run.started events")
    state = run.state
    if state is not None and state.status in HARD_TERMINAL and run.delivered[state.status] != 1:
        findings.add("hook_not_once", f"{run_id}: {run.delivered[state.status]} deliveries "
                                      f"of {hook_method} for {state.status} recorded")
    return state


def _check_event(run: _Run, item: LoggedEvent, event: Event, findings: _Findings,
                 runners: Counter[str], hook_method: str) -> None:
    """The checks of one event against the run before it."""
    where = f"{run.run_id}: {event.type} at seq {item.seq}"
    if item.expected_last_seq is not None and item.expected_last_seq != run.previous_seq:
        findings.add("chain_broken", f"{where} expected {item.expected_last_seq}, the run's "
                                     f"previous event is {run.previous_seq}")
    state = run.state
    if state is None and not isinstance(event, RunRequested):
        findings.add("fold_order", f"{where} before its run.requested")
    if isinstance(event, RunRunning):
        run.running += 1
        runners[event.data.runner_id] += 1
        if event.data.attempt > 1:
            findings.add("duplicate_turn", f"{where}: attempt {event.data.attempt}")
    elif isinstance(event, RunStarted):
        run.started += 1
    elif isinstance(event, RunMilestone) and state is not None \
            and event.data.sequence != state.next_milestone_sequence \
            and all(m.sequence != event.data.sequence for m in state.milestones):
        # (A milestone recorded already is a duplicate, which the fold refuses.)
        findings.add("fold_order", f"{run.run_id}: milestone {event.data.sequence} at seq "
                                   f"{item.seq} after {state.next_milestone_sequence} milestones")
    elif isinstance(event, RunFinishDelivered):
        if event.data.method == hook_method:
            run.delivered[event.data.status] += 1
        if state is not None and state.status != event.data.status:
            findings.add("fold_order", f"{run.run_id}: finish hook for {event.data.status} "
                                       f"recorded at seq {item.seq} while the run was "
                                       f"{state.status}")
