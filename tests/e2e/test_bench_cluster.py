"""`python -m bench.run --nats-nodes 3` end to end with few runs: the bench starts a
cluster of three nats-servers of its own, W1 runs on streams of three replicas, its
correctness is checked from the log, and its CPU per run is reported per node."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = 30


def test_bench_on_a_three_node_cluster(database_url: str, tmp_path: Path) -> None:
    # No TETHER_NATS_URL: the bench starts the cluster itself (and Postgres is the tests').
    env = {**{k: v for k, v in os.environ.items() if k != "TETHER_NATS_URL"},
           "TETHER_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--nats-nodes", "3", "--runs", str(RUNS),
         "--w2-runs", "0", "--submit-concurrency", "8", "--no-rebuild", "--no-chart",
         "--results-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.count("devstack: nats-server (pid") == 3
    [path] = tmp_path.glob("*.json")
    report = json.loads(path.read_text())

    w1 = report["w1"]
    assert (w1["runs"], w1["finished"]) == (RUNS, RUNS) and w1["correctness"]["ok"]
    assert report["events_stream_leader"] in {"n0", "n1", "n2"}
    # Each node's CPU on its own; none is left out and none is counted twice.
    nodes = {name for name in w1["cpu_ms_per_run"] if name.startswith("nats-server")}
    assert nodes == {"nats-server-1", "nats-server-2", "nats-server-3"}
    assert all(w1["cpu_ms_per_run"][node] > 0 for node in nodes)
    # The ceilings ran on a scratch stream of three replicas as well.
    assert report["ceilings"]["replicas"] == 3 and report["ceilings"]["append_async_per_s"] > 0
    assert re.search(rf"events stream leader\s+{report['events_stream_leader']}\s", done.stdout)
