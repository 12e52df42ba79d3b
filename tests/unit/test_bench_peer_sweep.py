"""A peer's sweep: the best complete configuration is the one Tether is compared with."""

from bench.peers import sweep
from bench.report import (
    alternated,
    peer_ratios,
    peers_table,
    ratios,
    strip_series,
    targets,
)
from bench.run import failures

DIRECT = {"mode": "direct", "workflow": "async", "hook": True}
QUEUE_2X16 = {"mode": "queue", "workflow": "sync", "processes": 2, "concurrency": 16,
              "polling_s": 0.1, "hook": True}
QUEUE_4X32 = {**QUEUE_2X16, "processes": 4, "concurrency": 32}


def measured(config: dict, runs: int, runs_per_s: float, finished: int | None = None) -> dict:
    finished = runs if finished is None else finished
    return {"config": config, "label": sweep.label(config), "runs": runs, "finished": finished,
            "seconds": finished / runs_per_s, "runs_per_s": runs_per_s}


class Peer:
    """Runs a configuration at a throughput set per (configuration label, runs)."""

    def __init__(self, figures: dict[tuple[str, int], tuple[float, int | None]]) -> None:
        self.figures, self.calls = figures, []

    def __call__(self, config: dict, runs: int) -> dict:
        self.calls.append((sweep.label(config), runs))
        runs_per_s, finished = self.figures[(sweep.label(config), runs)]
        return measured(config, runs, runs_per_s, finished)


def test_labels_name_the_configuration():
    assert sweep.label(DIRECT) == "direct async"
    assert sweep.label(QUEUE_2X16) == "queue sync 2x16 poll 0.1s"
    assert sweep.label({"mode": "workers", "pool": "threads", "processes": 1,
                        "concurrency": 32}) == "workers threads 1x32"


def test_best_ignores_incomplete_and_failed_points():
    points = [measured(DIRECT, 400, 13.4), measured(QUEUE_2X16, 400, 22.2),
              measured(QUEUE_4X32, 400, 90.0, finished=399),  # lost a run: fast at nothing
              {"config": QUEUE_4X32, "label": "x", "runs": 400, "error": "worker died"}]
    assert sweep.best(points)["config"] == QUEUE_2X16
    assert sweep.best(points[2:]) is None


def test_the_best_and_the_reference_are_run_again_with_the_bench_runs():
    peer = Peer({("direct async", 400): (13.0, None), ("queue sync 2x16 poll 0.1s", 400): (25.0, None),
                 ("queue sync 4x32 poll 0.1s", 400): (20.0, None),
                 ("queue sync 2x16 poll 0.1s", 2000): (22.2, None),
                 ("direct async", 2000): (13.4, None)})
    result = sweep.sweep("dbos", [DIRECT, QUEUE_2X16, QUEUE_4X32], DIRECT, runs=2000,
                         sweep_runs=400, run=peer, log=lambda _: None)
    assert peer.calls[3:] == [("queue sync 2x16 poll 0.1s", 2000), ("direct async", 2000)]
    assert [p["runs_per_s"] for p in result["sweep"]] == [13.0, 25.0, 20.0]
    assert (result["runs_per_s"], result["runs"], result["label"]) == (
        22.2, 2000, "queue sync 2x16 poll 0.1s")
    assert result["reference"]["runs_per_s"] == 13.4 and "error" not in result

    ratios = peer_ratios(222.0, {"dbos": result})
    assert round(ratios["w1_vs_dbos"], 6) == 10.0
    assert round(ratios["w1_vs_dbos_direct"], 6) == round(222.0 / 13.4, 6)
    assert ratios["w1_vs_celery"] is None and ratios["w1_vs_celery_default"] is None
    text = peers_table({"peers": {"dbos": result}, "ratios": ratios})
    assert "* queue sync 2x16 poll 0.1s" in text and "Tether / DBOS = 10.00x of the best" in text


def test_short_bench_compares_with_the_sweep_itself():
    peer = Peer({("direct async", 300): (13.0, None), ("queue sync 2x16 poll 0.1s", 300): (25.0, None)})
    result = sweep.sweep("dbos", [DIRECT, QUEUE_2X16], DIRECT, runs=300, sweep_runs=400,
                         run=peer, log=lambda _: None)
    assert len(peer.calls) == 2 and result["sweep_runs"] == 300
    assert result["runs_per_s"] == 25.0 and result["reference"]["runs_per_s"] == 13.0


def test_a_configuration_that_loses_runs_at_full_length_is_not_the_figure():
    figures = {("direct async", 400): (13.0, None), ("queue sync 2x16 poll 0.1s", 400): (25.0, None),
               ("queue sync 2x16 poll 0.1s", 2000): (24.0, 1990), ("direct async", 2000): (13.4, None)}
    result = sweep.sweep("dbos", [DIRECT, QUEUE_2X16], DIRECT, runs=2000, sweep_runs=400,
                         run=Peer(figures), log=lambda _: None)
    assert (result["label"], result["runs_per_s"]) == ("direct async", 13.4)
    assert [p["finished"] for p in result["confirmed"]] == [1990, 2000]

    figures[("direct async", 2000)] = (13.4, 1500)
    result = sweep.sweep("dbos", [DIRECT, QUEUE_2X16], DIRECT, runs=2000, sweep_runs=400,
                         run=Peer(figures), log=lambda _: None)
    assert "runs_per_s" not in result and "finished them all" in result["error"]
    assert peer_ratios(222.0, {"dbos": result})["w1_vs_dbos"] is None


def test_the_reference_wins_when_it_is_faster_over_the_bench_runs():
    peer = Peer({("direct async", 400): (13.0, None), ("queue sync 2x16 poll 0.1s", 400): (25.0, None),
                 ("queue sync 2x16 poll 0.1s", 2000): (14.0, None), ("direct async", 2000): (20.0, None)})
    result = sweep.sweep("dbos", [DIRECT, QUEUE_2X16], DIRECT, runs=2000, sweep_runs=400,
                         run=peer, log=lambda _: None)
    assert (result["label"], result["runs_per_s"]) == ("direct async", 20.0)
    assert result["best"] == result["reference"]


def tether_w1(runs_per_s: float, runs: int = 2000, finished: int | None = None) -> dict:
    return {"runs": runs, "finished": runs if finished is None else finished,
            "runs_per_s": runs_per_s, "cpu_ms_per_run": {"parent": 0.3},
            "correctness": {"ok": True}, "duplicate_hook_calls": 0, "submit_errors": 0,
            "crashed_services": [], "prefix": "benchx", "_accepted": ["r1"],
            "stages": {"big": "series"}}


def swept_dbos() -> dict:
    return sweep.sweep("dbos", [QUEUE_2X16], DIRECT, runs=400, sweep_runs=400,
                       run=Peer({("queue sync 2x16 poll 0.1s", 400): (38.0, None)}),
                       log=lambda _: None)


def test_alternated_pairs_give_the_median_of_their_ratios():
    pairs = [{"tether": tether_w1(640.0), "dbos": measured(QUEUE_2X16, 2000, 40.0)},
             {"tether": tether_w1(480.0), "dbos": measured(QUEUE_2X16, 2000, 30.0)},
             {"tether": tether_w1(700.0), "dbos": measured(QUEUE_2X16, 2000, 35.0)}]
    paired = alternated("dbos", pairs)
    assert [pair["ratio"] for pair in paired["pairs"]] == [16.0, 16.0, 20.0]
    assert paired["median_ratio"] == 16.0
    # A pair keeps Tether's verdict and figures, not W1's series.
    assert set(paired["pairs"][0]["tether"]) == {
        "runs", "finished", "runs_per_s", "cpu_ms_per_run", "correctness",
        "duplicate_hook_calls", "submit_errors", "crashed_services", "prefix"}

    report = {"w1": {"runs_per_s": 600.0, "events_appended_per_s": 3600.0,
                     "events_projected_per_s": 3600.0}, "peers": {},
              "alternated": {"dbos": paired}}
    assert ratios(report)["w1_vs_dbos_alternated"] == 16.0
    text = peers_table({"peers": {"dbos": swept_dbos()}, "ratios": {"w1_vs_dbos": 16.5},
                        "alternated": {"dbos": paired}})
    assert "alternated, each pair one run after the other: 16.00x" in text
    assert "pair 3: Tether 700.0 runs/s (2000/2000), DBOS 35.0 runs/s: 20.00x" in text


def test_a_pair_with_an_unfinished_run_has_no_ratio():
    pairs = [{"tether": tether_w1(640.0, finished=1999), "dbos": measured(QUEUE_2X16, 2000, 40.0)},
             {"tether": tether_w1(480.0), "dbos": measured(QUEUE_2X16, 2000, 30.0, 1990)},
             {"tether": tether_w1(510.0), "dbos": measured(QUEUE_2X16, 2000, 30.0)}]
    paired = alternated("dbos", pairs)
    assert [pair["ratio"] for pair in paired["pairs"]] == [None, None, 17.0]
    assert paired["median_ratio"] == 17.0
    assert alternated("dbos", pairs[:2])["median_ratio"] is None
    text = peers_table({"peers": {"dbos": swept_dbos()}, "ratios": {},
                        "alternated": {"dbos": paired}})
    assert "pair 1: Tether 640.0 runs/s (1999/2000), DBOS 40.0 runs/s: -" in text
    assert "pair 2: Tether 480.0 runs/s (2000/2000), DBOS incomplete 1990/2000: -" in text


def test_an_alternated_w1_that_is_not_whole_fails_the_bench():
    broken = tether_w1(640.0, finished=1999) | {"crashed_services": ["parent"],
                                                 "duplicate_hook_calls": 1}
    paired = alternated("dbos", [{"tether": tether_w1(600.0), "dbos": measured(QUEUE_2X16, 2000, 40.0)},
                                 {"tether": broken, "dbos": measured(QUEUE_2X16, 2000, 40.0)}])
    found = failures({"w1": tether_w1(600.0), "crashed_services": [],
                      "alternated": {"dbos": paired}})
    assert found == ["alternated W1 2 (dbos): 1999 of 2000 runs finished",
                     "alternated W1 2 (dbos): 1 duplicate hook calls, 0 failed requests",
                     "crashed services: parent"]
    assert failures({"w1": tether_w1(600.0), "crashed_services": []}) == []


def test_the_json_leaves_out_series_inside_lists():
    assert strip_series({"pairs": [{"_accepted": [1], "runs": 2}], "_x": 1}) == {
        "pairs": [{"runs": 2}]}


RESTATE_BEST = {"workers": 2, "in_flight": 64, "partitions": 2, "fsync": False,
                "hook": "service"}
RESTATE_DEFAULT = {**RESTATE_BEST, "partitions": 24, "fsync": True}


def restate_point(config: dict, runs_per_s: float, w2: tuple[float, float],
                  w2_unkeyed: tuple[float, float]) -> dict:
    return measured(config, 2000, runs_per_s) | {
        "w2": {"runs": 200, "p50_ms": w2[0], "p99_ms": w2[1]},
        "w2_unkeyed": {"runs": 200, "p50_ms": w2_unkeyed[0], "p99_ms": w2_unkeyed[1]},
        "cpu_ms_per_run": {"restate-server": 1.5, "sdk-workers": 1.8, "driver": 0.3,
                           "all": 3.6}}


def test_restate_is_compared_at_its_best_for_throughput_and_for_awaited_calls():
    assert sweep.label(RESTATE_BEST) == (
        "2 workers, 64 in flight, 2 partitions, fsync off, hook service")
    best = restate_point(RESTATE_BEST, 500.0, (5.0, 9.0), (4.0, 11.0))
    default = restate_point(RESTATE_DEFAULT, 400.0, (6.0, 10.0), (6.5, 10.5))
    restate = sweep.sweep("restate", [RESTATE_BEST, RESTATE_DEFAULT], RESTATE_DEFAULT,
                          runs=2000, sweep_runs=2000,
                          run=lambda config, _: best if config == RESTATE_BEST else default,
                          log=lambda _: None)
    report = {"w1": {"runs_per_s": 1000.0, "events_appended_per_s": 6000.0,
                     "events_projected_per_s": 6000.0, "progress_latency": {"p99_ms": 20.0},
                     "cpu_ms_per_run": {"parent": 0.5, "nats-server": 0.5, "probe": 0.1,
                                        "others": 0.4}},
              "w2": {"round_trip": {"p50_ms": 3.0, "p99_ms": 9.9}},
              "peers": {"restate": restate}}
    report["ratios"] = ratios(report)
    # Its best configuration's calls, the lower of with and without an idempotency key.
    assert report["ratios"]["w1_vs_restate"] == 2.0
    assert report["ratios"]["w1_vs_restate_default"] == 2.5
    assert report["ratios"]["w2_p50_vs_restate"] == 0.75
    assert round(report["ratios"]["w2_p99_vs_restate"], 6) == 1.1
    met = targets(report)
    assert met["w1_vs_restate"]["met"] is True
    assert (met["w2_p50_vs_restate"]["met"], met["w2_p99_vs_restate"]["met"]) == (True, False)
    text = peers_table(report)
    assert ("awaited calls p50/p99: Tether 3.00 / 9.90 ms, Restate 4.00 / 9.00 ms "
            "(2 workers, 64 in flight, 2 partitions, fsync off, hook service)") in text
    # Tether's processes without the probe and the rest of the machine.
    assert "CPU ms per W1 run: Tether 1.00 (" in text and "Restate 3.60 (server 1.50" in text
