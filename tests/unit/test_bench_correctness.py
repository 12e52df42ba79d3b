"""The bench's correctness checks of a W1 (bench/correctness.py): a history as the services
write it passes, and each doctored one fails the check it breaks."""

import dataclasses
import itertools
from typing import Any

import msgspec
import pytest

from bench.correctness import CHECKS, LoggedEvent, check_w1
from tether.domain.event_envelope import EventEnvelope
from tether.domain.events import (
    ParentRef,
    RunCompleted,
    RunFinishDelivered,
    RunMilestone,
    RunRequested,
    RunRunning,
    RunStarted,
)

PARENT = ParentRef(agent="BenchApp", name="bench-0")
HOOK = "on_bench_done"
T0 = 1_700_000_000_000
RUNS = ("w1-0", "w1-1", "w1-2")

_ids = itertools.count()


def make(event_cls: type[EventEnvelope], run_id: str, data: dict[str, Any]) -> Any:
    return msgspec.convert({"event_id": f"e{next(_ids)}", "run_id": run_id, "parent": PARENT,
                            "occurred_at": T0 + next(_ids), "data": data}, event_cls)


def w1_run(run_id: str, runner: str = "runner-a") -> list[Any]:
    """A W1 run's events as the services append them."""
    return [
        make(RunRequested, run_id, {"agent_type": "BenchChild", "input": {"n": 0},
                                    "detached": {"on_finish": HOOK},
                                    "nested_parent": f"{run_id}:tree"}),
        make(RunRunning, run_id, {"attempt": 1, "runner_id": runner}),
        make(RunMilestone, run_id, {"sequence": 0, "name": "half-way"}),
        make(RunMilestone, run_id, {"sequence": 1, "name": "finished-work"}),
        make(RunCompleted, run_id, {"summary": "done"}),
        make(RunFinishDelivered, run_id, {"status": "completed", "method": HOOK,
                                          "message_id": f"finish:{run_id}:completed"}),
    ]


def subject(run_id: str) -> str:
    return f"bench.evt.{PARENT.agent}.{PARENT.name}.{run_id}"


def logged(runs: dict[str, list[Any]], unconditional: frozenset[str] = frozenset()) -> list[LoggedEvent]:
    """The runs' events interleaved in the stream, each append expecting its run's
    previous sequence unless its event id is in `unconditional`."""
    stored, last = [], dict.fromkeys(runs, 0)
    seq = itertools.count(1)
    for events in itertools.zip_longest(*runs.values()):
        for run_id, event in zip(runs, events, strict=True):
            if event is None:
                continue
            at = next(seq)
            expected = None if event.event_id in unconditional else last[run_id]
            stored.append(LoggedEvent(at, subject(run_id), expected, event))
            last[run_id] = at
    return stored


def verdict(history: list[LoggedEvent], *, hook_calls: dict[str, int] | None = None,
            accepted: tuple[str, ...] = RUNS) -> dict:
    calls = dict.fromkeys(accepted, 1) if hook_calls is None else hook_calls
    return check_w1(history, accepted=accepted, hook_calls=calls, hook_method=HOOK)


def failed(result: dict) -> dict[str, int]:
    return {check: count for check, count in result["violations"].items() if count}


def good_runs() -> dict[str, list[Any]]:
    return {run_id: w1_run(run_id, runner=f"runner-{n % 2}") for n, run_id in enumerate(RUNS)}


def test_a_history_as_the_services_write_it_passes():
    result = verdict(logged(good_runs()))

    assert result["ok"] and failed(result) == {}
    assert set(result["violations"]) == set(CHECKS)
    assert (result["runs"], result["events"], result["conditional_appends"]) == (3, 18, 18)
    assert result["runners"] == {"runner-0": 2, "runner-1": 1}


def test_events_of_other_runs_are_not_checked():
    runs = good_runs() | {"w2-0": w1_run("w2-0")[:2]}  # an awaited run, still running

    assert verdict(logged(runs))["ok"]


def test_a_run_missing_from_the_log_is_lost():
    runs = good_runs()
    del runs["w1-1"]

    result = verdict(logged(runs))

    assert failed(result) == {"lost": 1}
    assert result["examples"]["lost"] == ["w1-1: not in the log"]


def test_a_run_without_its_outcome_is_lost():
    runs = good_runs()
    runs["w1-2"] = runs["w1-2"][:4]  # requested, running, both milestones

    result = verdict(logged(runs))

    assert failed(result) == {"lost": 1}
    assert "w1-2: no outcome" in result["examples"]["lost"][0]


def test_a_run_whose_hook_never_ran_is_lost():
    result = verdict(logged(good_runs()), hook_calls={"w1-0": 1, "w1-2": 1})

    assert failed(result) == {"lost": 1}
    assert result["examples"]["lost"] == ["w1-1: its finish hook was never handled"]


def test_an_append_that_did_not_land_after_the_event_it_expected_breaks_the_chain():
    history = logged(good_runs())
    # w1-0's second milestone expected the sequence of its first milestone's predecessor:
    # an append decided from a stale history that the log took anyway.
    second = next(i for i, item in enumerate(history)
                  if item.event.run_id == "w1-0" and item.event.type == "run.milestone"
                  and item.event.data.sequence == 1)
    running = next(item for item in history
                   if item.event.run_id == "w1-0" and item.event.type == "run.running")
    history[second] = dataclasses.replace(history[second], expected_last_seq=running.seq)

    result = verdict(history)

    assert failed(result) == {"chain_broken": 1}
    assert "w1-0: run.milestone" in result["examples"]["chain_broken"][0]


def test_milestones_out_of_their_order_break_the_fold_order():
    runs = good_runs()
    events = runs["w1-1"]
    events[2], events[3] = events[3], events[2]

    result = verdict(logged(runs))

    assert failed(result) == {"fold_order": 2}
    assert [example.split(" at ")[0] for example in result["examples"]["fold_order"]] == [
        "w1-1: milestone 1", "w1-1: milestone 0"]


def test_a_hook_recorded_before_the_outcome_breaks_the_fold_order():
    runs = good_runs()
    events = runs["w1-0"]
    events[4], events[5] = events[5], events[4]

    result = verdict(logged(runs))

    assert failed(result) == {"fold_order": 1}
    assert "finish hook for completed" in result["examples"]["fold_order"][0]


def test_an_event_before_its_run_breaks_the_fold_order_and_is_refused():
    runs = good_runs()
    events = runs["w1-2"]
    events[0], events[1] = events[1], events[0]

    result = verdict(logged(runs))

    assert failed(result).keys() >= {"fold_order", "fold_refused"}
    assert "run.running" in result["examples"]["fold_order"][0]


def test_an_event_appended_twice_is_refused_by_the_fold():
    runs = good_runs()
    again = msgspec.structs.replace(runs["w1-0"][2], event_id="again")
    runs["w1-0"].insert(4, again)

    result = verdict(logged(runs, unconditional=frozenset({"again"})))

    assert failed(result) == {"fold_refused": 1}
    assert "duplicate: milestone 0" in result["examples"]["fold_refused"][0]


def test_an_undecodable_event_is_refused():
    history = logged(good_runs())
    history.append(LoggedEvent(len(history) + 1, subject("w1-0"), None, None))

    assert failed(verdict(history)) == {"fold_refused": 1}


@pytest.mark.parametrize("attempt", [1, 2])
def test_a_second_child_turn_is_a_duplicate_turn(attempt: int):
    runs = good_runs()
    runs["w1-1"].insert(2, make(RunRunning, "w1-1", {"attempt": attempt,
                                                     "runner_id": "runner-b"}))

    result = verdict(logged(runs))

    assert result["violations"]["duplicate_turn"] >= 1
    assert any(example.startswith("w1-1:") for example in result["examples"]["duplicate_turn"])


def test_two_dispatches_are_a_duplicate_turn():
    runs = good_runs()
    for _ in range(2):
        runs["w1-2"].insert(1, make(RunStarted, "w1-2", {"work_subject": "bench.work.BenchChild"}))

    result = verdict(logged(runs))

    assert result["violations"]["duplicate_turn"] == 1
    assert result["examples"]["duplicate_turn"] == ["w1-2: 1 run.running and 2 run.started events"]


def test_a_hook_function_that_ran_twice_is_not_once():
    result = verdict(logged(good_runs()), hook_calls={"w1-0": 1, "w1-1": 2, "w1-2": 1})

    assert failed(result) == {"hook_not_once": 1}
    assert result["examples"]["hook_not_once"] == ["w1-1: the hook function ran 2 times"]


def test_a_hook_delivered_twice_in_the_ledger_is_not_once():
    runs = good_runs()
    runs["w1-2"].append(msgspec.structs.replace(runs["w1-2"][-1], event_id="twice"))

    result = verdict(logged(runs, unconditional=frozenset({"twice"})))

    assert result["violations"]["hook_not_once"] == 1
    assert "2 deliveries of on_bench_done for completed" in result["examples"]["hook_not_once"][0]


def test_a_hook_never_recorded_in_the_ledger_is_not_once():
    runs = good_runs()
    runs["w1-0"].pop()

    result = verdict(logged(runs))

    assert failed(result) == {"hook_not_once": 1}
