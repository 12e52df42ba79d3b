"""The bench's verdicts: a run made to look inside (every subject counted, a service under
callgrind) judges no target, since its own load moves every time it measures."""

import pytest

from bench.report import diagnostic, targets

W1 = {"runs_per_s": 400.0, "progress_latency": {"p99_ms": 320.0}}


def report(**params) -> dict:
    return {"meta": {"params": {"count_subjects": False, "callgrind": None, **params}},
            "w1": W1, "w2": {"round_trip": {"p50_ms": 3.0}}, "ratios": {}, "memory": {}}


def test_a_plain_run_judges_its_targets() -> None:
    plain = report()
    assert diagnostic(plain) == []
    verdicts = targets(plain)
    assert verdicts["w1_runs_per_s"]["met"] is False
    assert verdicts["progress_p99_ms"]["met"] is False
    assert verdicts["w2_p50_ms"]["met"] is True


@pytest.mark.parametrize(("params", "named"), [({"count_subjects": True}, "--count-subjects"),
                                               ({"callgrind": "parent"}, "--callgrind")])
def test_a_diagnostic_run_judges_none_and_says_why(params, named) -> None:
    run = report(**params)
    assert [text.split(" ")[0] for text in diagnostic(run)] == [named]
    verdicts = targets(run)
    assert all(verdict["met"] is None for verdict in verdicts.values()), verdicts
    # The figures are still reported.
    assert verdicts["progress_p99_ms"]["value"] == 320.0
