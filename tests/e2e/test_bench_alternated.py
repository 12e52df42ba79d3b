"""`make bench-peers`' alternated pairs with few runs: each pair is a Tether W1 on services
of its own, with its correctness checked from the log, and the peer's best configuration
run right after it. The peer here is a stand-in that reports a set throughput (the peers
themselves are optional installs, `tests/e2e/test_bench_peer_celery.py`)."""

import statistics
from pathlib import Path

from bench.peers import sweep
from bench.run import alternated, failures, parse_args

RUNS = 20
QUEUE = {"mode": "queue", "workflow": "sync", "processes": 4, "concurrency": 8,
         "polling_s": 0.1, "hook": True}


async def test_each_pair_is_a_fresh_w1_then_the_peer(nats_url: str, database_url: str,
                                                     tmp_path: Path) -> None:
    args = parse_args(["--runs", str(RUNS), "--submit-concurrency", "8", "--peer-pairs", "2"])
    calls = []

    def peer(config: dict, runs: int) -> dict:
        # The W1s begun so far: the peer runs after its pair's W1, before the next one.
        calls.append((config, runs, sorted(p.name for p in tmp_path.glob("pair-*"))))
        runs_per_s = 4.0 * len(calls)
        return {"config": config, "label": sweep.label(config), "runs": runs,
                "finished": runs, "seconds": runs / runs_per_s, "runs_per_s": runs_per_s}

    paired = await alternated(args, nats_url, database_url, {}, tmp_path, "dbos",
                              {"config": QUEUE}, run_peer=peer)

    assert calls == [(QUEUE, RUNS, ["pair-1"]), (QUEUE, RUNS, ["pair-1", "pair-2"])]
    pairs = paired["pairs"]
    assert [pair["dbos"]["runs_per_s"] for pair in pairs] == [4.0, 8.0]
    assert len({pair["tether"]["prefix"] for pair in pairs}) == 2  # a log of its own each
    for pair in pairs:
        ours = pair["tether"]
        assert (ours["runs"], ours["finished"], ours["crashed_services"]) == (RUNS, RUNS, [])
        assert ours["correctness"]["ok"] and ours["correctness"]["runs"] == RUNS
        assert pair["ratio"] == ours["runs_per_s"] / pair["dbos"]["runs_per_s"] > 0
    assert paired["median_ratio"] == statistics.median(pair["ratio"] for pair in pairs)
    assert failures({"w1": pairs[0]["tether"], "crashed_services": [],
                     "alternated": {"dbos": paired}}) == []
