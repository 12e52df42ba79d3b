"""A peer's sweep: the best complete configuration is the one Tether is compared with."""

from bench.peers import sweep
from bench.report import peer_ratios, peers_table

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
