"""The Celery peer of the benchmark for real: a throwaway redis-server, a `celery worker`
process and the bench's Postgres, with a few runs, so the peer cannot silently rot."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("celery", reason="the `peers` extra (celery[redis]) is not installed")
if shutil.which("redis-server") is None:
    pytest.skip("no redis-server (Debian `redis-server`)", allow_module_level=True)


def test_celery_w1_runs_every_hook_and_reports_its_sweep(database_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TETHER_BENCH_REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.peers.celery_w1", "--database-url", database_url,
         "--runs", "30", "--sweep-runs", "30", "--grid", "quick", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["redis"] == "throwaway redis-server" and "error" not in result
    [point] = result["sweep"]
    assert point["label"] == "workers threads 1x4" and "worker_errors" not in point
    # Every run's hook learned by the driver, and its rows written by the workers.
    assert (point["runs"], point["finished"]) == (30, 30)
    assert (point["finish_rows"], point["milestone_rows"]) == (30, 60)
    assert result["best"] == point and result["runs_per_s"] == point["runs_per_s"] > 0
