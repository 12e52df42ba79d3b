"""A peer's configurations swept, and Tether compared with the best of them.

Each point of a sweep is one configuration of the peer (how it is deployed and tuned)
run as its own process, so no point inherits another's threads, pools or caches. The
sweep runs every point with `sweep_runs` runs; when the bench asks for more runs than
that, the best point and the reference point (the peer as deployed by default, e.g.
DBOS started directly) are run again with the bench's own number of runs, and the
better of those two is the figure compared with Tether: a short run counts the peer's
start-up and ramp against it more than a long one does, and the sweep's short runs on a
shared machine only choose the candidates.

A point counts only when every one of its runs finished: a configuration that loses or
stalls runs is fast at nothing.
"""

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from bench.stack import REPO


def label(config: dict) -> str:
    """A configuration in a few words, e.g. `queue sync 2x16 poll 0.1s`."""
    if "partitions" in config:  # Restate
        return (f"{config['workers']} workers, {config['in_flight']} in flight, "
                f"{config['partitions']} partitions, fsync {'on' if config['fsync'] else 'off'}, "
                f"hook {config['hook']}")
    parts = [config["mode"]]
    if "workflow" in config:
        parts.append(config["workflow"])
    if "pool" in config:
        parts.append(config["pool"])
    if config["mode"] != "direct":
        parts.append(f"{config['processes']}x{config['concurrency']}")
    if "polling_s" in config:
        parts.append(f"poll {config['polling_s']:g}s")
    return " ".join(parts)


def complete(point: dict) -> bool:
    return ("error" not in point and point.get("runs", 0) > 0
            and point.get("finished") == point.get("runs") and point.get("runs_per_s", 0) > 0)


def best(points: Sequence[dict]) -> dict | None:
    """The complete point with the highest throughput (the first of equals), or None."""
    candidates = [p for p in points if complete(p)]
    return max(candidates, key=lambda p: p["runs_per_s"], default=None)


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_point(module: str, config: dict, runs: int, args: Sequence[str],
              timeout: float | None = None) -> dict:
    """`python -m <module> point --config JSON --runs N ...` as its own process; its JSON.
    It is given `timeout` seconds (default: two minutes and half a second per run).

    With `cpu`: over the point's whole process (start-up included), the cores the machine
    had busy and those the peer's own processes used (the driver and its workers, not
    Postgres or Redis): on a shared machine, the difference is mostly other work."""
    command = [sys.executable, "-m", module, "point", "--config", json.dumps(config),
               "--runs", str(runs), *args]
    if timeout is None:
        timeout = 120 + runs / 2
    began, busy = time.monotonic(), machine_busy_seconds()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "label": label(config), "runs": runs,
                "error": f"timed out after {timeout:.0f} s"}
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {"wall_s": wall, "machine_cores_busy": (machine_busy_seconds() - busy) / wall,
           "peer_cores": (after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime) / wall}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"config": config, "label": label(config), "runs": runs, "cpu": cpu,
                "error": (done.stderr or done.stdout)[-1500:]}
    return {**json.loads(lines[-1]), "cpu": cpu}


def sweep(system: str, grid: Sequence[dict], reference: dict, runs: int, sweep_runs: int,
          run: Callable[[dict, int], dict], log: Callable[[str], None]) -> dict:
    """Every point of `grid` at `sweep_runs`; the best and `reference` again at `runs`.

    `runs_per_s` of the result is the best configuration's, the figure Tether is
    compared with; `reference` is reported beside it (None when not in `grid`).
    """
    points = []
    for config in grid:
        point = run(config, min(sweep_runs, runs))
        points.append(point)
        log(f"{system} {point['label']}: " + (
            f"{point['runs_per_s']:.1f} runs/s" if complete(point) else
            f"incomplete ({point.get('finished', 0)}/{point['runs']}) "
            f"{point.get('error', '')[-300:]}"))
    chosen = best(points)
    reference_point = next((p for p in points if p["config"] == reference), None)
    confirmed = []
    if chosen is not None and runs > sweep_runs:
        confirmed.append(run(chosen["config"], runs))
        if reference_point is not None:
            reference_point = (confirmed[0] if reference == chosen["config"]
                               else run(reference, runs))
            if reference_point is not confirmed[0]:
                confirmed.append(reference_point)
        for point in confirmed:
            log(f"{system} {point['label']} at {runs} runs: "
                f"{point.get('runs_per_s', 0):.1f} runs/s")
        # The best of what ran with the bench's runs: the sweep's short runs only
        # chose the candidates.
        chosen = best(confirmed) or confirmed[0]
    result = {"system": system, "sweep_runs": min(sweep_runs, runs), "sweep": points,
              "confirmed": confirmed, "best": chosen, "reference": reference_point}
    if chosen is None or not complete(chosen):
        result["error"] = "no configuration finished all its runs" if chosen is None else (
            f"no configuration run with {runs} runs finished them all ({chosen['label']}: "
            f"{chosen.get('finished', 0)}/{runs}) {chosen.get('error', '')[-500:]}")
        return result
    result.update(runs=chosen["runs"], runs_per_s=chosen["runs_per_s"], label=chosen["label"],
                  seconds=chosen["seconds"])
    return result


def emit(title: str, result: dict, *, as_json: bool) -> None:
    """A peer's sweep on stdout: one JSON line (what the bench reads), or one line to read."""
    print(json.dumps(result) if as_json else
          f"{title} W1, best of {len(result['sweep'])} configurations: "
          f"{result.get('label')} {result.get('runs_per_s', 0):.1f} runs/s")
