"""Two builds' W1, alternated in one sitting: what a change does to the CPU per run.

    python -m bench.compare BASE [HEAD] [--pairs 3] [--runs 3000] [-- bench.run options]

BASE and HEAD are git revisions, or `.` for the working tree as it is (HEAD's default).
A revision is taken out of git into a directory of its own (`git archive`), and each W1
runs there, on the same virtual environment, with that tree's `libs/` and root first on
`PYTHONPATH` (ahead of the editable install), so the services it starts are that tree's.

This machine's speed drifts by up to 30 % within minutes, so one run of each says little.
The runs go in pairs whose order alternates (A B, B A, A B, ...), so a steady drift
weighs on both sides alike, and the verdict is the median of the pairs' ratios. The CPU
of each process is reported beside it: a change meant for one process should move that
one, and leave the others within their drift. Options after `--` go to every bench.run:
with `-- --callgrind SERVICE`, the instructions per run of that service are compared
too, a figure the machine's speed does not change.
"""

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.stack import REPO

RESULTS = REPO / "bench" / "results"
WORKING_TREE = "."
# The processes of a W1 whose CPU is the run's: the probe measures, `others` is the machine.
NOT_THE_RUN = ("probe", "others")


def materialize(revision: str, into: Path, repo: Path = REPO) -> Path:
    """The tree of `revision` (any git revision) under `into`; `.` is `repo` itself."""
    if revision == WORKING_TREE:
        return repo
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet",
                             f"{revision}^{{commit}}"], check=False, capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise SystemExit(f"bench.compare: {revision!r} is not a git revision of {repo}")
    tree = into / commit.stdout.strip()[:12]
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar",
                              commit.stdout.strip()], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def tree_env(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a run in `tree` gets: that tree's code ahead of any installed one."""
    env = dict(os.environ if base is None else base)
    own = [str(tree / "libs"), str(tree)]
    if env.get("PYTHONPATH"):
        own.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(own)
    return env


def order(pairs: int) -> list[str]:
    """`A B`, then `B A`, and so on: which side runs first alternates from pair to pair."""
    sides: list[str] = []
    for pair in range(pairs):
        sides += ["A", "B"] if pair % 2 == 0 else ["B", "A"]
    return sides


def run_w1(tree: Path, options: list[str], results_dir: Path) -> dict:
    """One `bench.run` in `tree`: its result, with its exit code and the reasons it gave
    for a failure (its `FAILED:` lines)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    before = set(results_dir.glob("*.json"))
    done = subprocess.run([sys.executable, "-m", "bench.run", *options,
                           "--results-dir", str(results_dir)],
                          cwd=tree, env=tree_env(tree), check=False, capture_output=True,
                          text=True)
    written = sorted(set(results_dir.glob("*.json")) - before)
    if not written:
        raise SystemExit(f"bench.compare: bench.run in {tree} wrote no result (exit code "
                         f"{done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    result = json.loads(written[-1].read_text())
    result["compare"] = {"exit_code": done.returncode, "file": str(written[-1]),
                         "failures": [line.removeprefix("FAILED: ")
                                      for line in done.stderr.splitlines()
                                      if line.startswith("FAILED: ")]}
    return result


def figures(result: dict) -> dict:
    """What is compared of one W1: CPU ms per run by process and in all, throughput,
    messages, and a callgrind count when there is one."""
    w1 = result["w1"]
    cpu = {name: ms for name, ms in (w1.get("cpu_ms_per_run") or {}).items()
           if name not in NOT_THE_RUN}
    found = {"runs_per_s": w1.get("runs_per_s"), "cpu": cpu,
             "cpu_total": sum(cpu.values()) if cpu else None,
             "msgs_in": (w1.get("server_work_per_run") or {}).get("nats_msgs_in"),
             "correct": bool((w1.get("correctness") or {}).get("ok")),
             "exit_code": (result.get("compare") or {}).get("exit_code", 0),
             "failures": (result.get("compare") or {}).get("failures", [])}
    if result.get("callgrind"):
        found["instructions"] = {result["callgrind"]["service"]:
                                 result["callgrind"]["per_run"]}
    return found


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _change(a: float | None, b: float | None) -> float | None:
    return None if not a or b is None else b / a - 1


def summarize(sides: list[str], runs: list[dict]) -> dict:
    """The medians of each side, B's change over A, and the ratio of each pair's totals
    (`sides[i]` names the side of `runs[i]`, in the order they ran)."""
    found = [figures(result) for result in runs]
    by_side: dict[str, list[dict]] = {"A": [], "B": []}
    for side, figured in zip(sides, found, strict=True):
        by_side[side].append(figured)

    def row(label: str, pick: Callable[[dict], float | None]) -> dict:
        a = _median([pick(f) for f in by_side["A"]])
        b = _median([pick(f) for f in by_side["B"]])
        return {"figure": label, "a": a, "b": b, "change": _change(a, b)}

    rows = [row(f"CPU ms per run: {process}", lambda f, p=process: f["cpu"].get(p))
            for process in sorted({p for f in found for p in f["cpu"]})]
    rows += [row(label, lambda f, k=key: f[k])
             for key, label in (("cpu_total", "CPU ms per run: all"),
                                ("runs_per_s", "W1 runs/s"),
                                ("msgs_in", "NATS messages in per run"))]
    rows += [row(f"instructions per run: {service}",
                 lambda f, s=service: f.get("instructions", {}).get(s))
             for service in sorted({s for f in found for s in f.get("instructions", {})})]
    pair_ratios = []
    for first in range(0, len(runs) - 1, 2):
        pair = {sides[i]: found[i] for i in (first, first + 1)}
        a, b = pair.get("A", {}).get("cpu_total"), pair.get("B", {}).get("cpu_total")
        if a and b is not None:
            pair_ratios.append(b / a)
    failed = [f"{side} run {i + 1}: exit code {f['exit_code']}, correct {f['correct']}"
              + "".join(f"; {why}" for why in f["failures"])
              for side, group in by_side.items() for i, f in enumerate(group)
              if f["exit_code"] != 0 or not f["correct"]]
    return {"rows": rows, "pair_ratios": pair_ratios,
            "median_pair_ratio": _median(pair_ratios), "failed": failed}


def render(summary: dict, base: str, head: str) -> str:
    def number(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value / 1e6:.3f} M" if value >= 1e5 else f"{value:.3f}"

    lines = [f"{'':40} {'A ' + base:>16} {'B ' + head:>16} {'B over A':>9}"]
    for row in summary["rows"]:
        change = "-" if row["change"] is None else f"{row['change'] * 100:+.1f} %"
        lines.append(f"{row['figure']:40} {number(row['a']):>16} {number(row['b']):>16} "
                     f"{change:>9}")
    ratios = ", ".join(f"{r:.3f}" for r in summary["pair_ratios"])
    median = summary["median_pair_ratio"]
    lines.append(f"CPU per run, B over A in each pair: {ratios or '-'}; median "
                 f"{'-' if median is None else f'{median:.3f}'}")
    for failure in summary["failed"]:
        lines.append(f"FAILED: {failure}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, passed = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="git revision of A, or . for the working tree")
    parser.add_argument("head", nargs="?", default=WORKING_TREE,
                        help="git revision of B, or . for the working tree (default)")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of W1 runs (default 3)")
    parser.add_argument("--runs", type=int, default=3000, help="W1 runs in each (default 3000)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs {args.pairs}: at least one pair")
    return args, passed


def main(argv: list[str] | None = None) -> int:
    args, passed = parse_args(argv)
    options = ["--runs", str(args.runs), "--w2-runs", "0", "--no-ceilings", "--no-rebuild",
               "--no-chart", *passed]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"compare-{stamp}"
    trees_dir = Path(tempfile.mkdtemp(prefix="tether-compare-"))
    try:
        trees = {"A": materialize(args.base, trees_dir / "A"),
                 "B": materialize(args.head, trees_dir / "B")}
        sides = order(args.pairs)
        runs = []
        for i, side in enumerate(sides):
            print(f"bench.compare: run {i + 1} of {len(sides)}: {side} "
                  f"({args.base if side == 'A' else args.head})", file=sys.stderr, flush=True)
            runs.append(run_w1(trees[side], options, out / side))
    finally:
        shutil.rmtree(trees_dir, ignore_errors=True)
    summary = summarize(sides, runs)
    (out / "compare.json").write_text(json.dumps(
        {"base": args.base, "head": args.head, "options": options, "sides": sides,
         "files": [r["compare"]["file"] for r in runs], **summary}, indent=2))
    print(render(summary, args.base, args.head))
    print(f"\n{out / 'compare.json'}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
