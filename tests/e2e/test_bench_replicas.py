"""`python -m bench.run --replicas 2` end to end with few runs: W1 again on two parents and
two child-runners, its correctness checked from the log, and its CPU per run per process
reported beside the single-replica W1's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS = 30


def test_bench_with_two_replicas(nats_url: str, database_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "TETHER_NATS_URL": nats_url, "TETHER_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--replicas", "2", "--runs", str(RUNS),
         "--w2-runs", "0", "--submit-concurrency", "8", "--no-rebuild", "--no-ceilings",
         "--no-chart", "--results-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "W1 with 2 parents and 2 child-runners" in done.stdout
    [path] = tmp_path.glob("*.json")
    report = json.loads(path.read_text())

    single, replicated = report["w1"], report["w1_replicated"]
    # (The projector and the reconciler in one process, the bench's default layout.)
    assert replicated["replicas"] == {"parent": 2, "child-runner": 2, "projector,reconciler": 1}
    assert (replicated["runs"], replicated["finished"]) == (RUNS, RUNS)
    assert replicated["prefix"] != report["meta"]["prefix"]
    assert replicated["crashed_services"] == []
    for w in (single, replicated):
        verdict = w["correctness"]
        assert verdict["ok"], verdict
        assert (verdict["runs"], set(verdict["violations"].values())) == (RUNS, {0})
        # Every event of a W1 run but its delivery record (a fact the parent appends as
        # the hook handler reported it) is appended expecting the run's last sequence:
        # the chain check read the stored headers, it did not pass for want of them.
        assert verdict["conditional_appends"] == verdict["events"] - RUNS >= 5 * RUNS
    assert sum(replicated["correctness"]["runners"].values()) == RUNS
    assert sum(replicated["run_commands_per_parent"].values()) == RUNS
    assert set(replicated["run_commands_per_parent"]) == {"parent-1", "parent-2"}

    processes = set(replicated["cpu_ms_per_run"])
    assert processes >= {"parent-1", "parent-2", "child-runner-1", "child-runner-2",
                         "projector,reconciler", "nats-server", "bench-app"}
    by_service = replicated["cpu_ms_per_run_by_service"]
    assert set(by_service) == set(single["cpu_ms_per_run_by_service"])
    assert by_service["parent"] == pytest.approx(replicated["cpu_ms_per_run"]["parent-1"]
                                    + replicated["cpu_ms_per_run"]["parent-2"])
    assert by_service["child-runner"] > 0 and single["cpu_ms_per_run_by_service"]["parent"] > 0
