"""`bench.compare`: two builds' W1 in alternated pairs, each run on its own tree's code."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare import materialize, order, render, summarize, tree_env
from bench.stack import REPO


def result(total: float, *, child_runner: float = 0.5, ok: bool = True, exit_code: int = 0,
           instructions: float | None = None, failures: tuple[str, ...] = ()) -> dict:
    """A bench.run result with the figures bench.compare reads."""
    cpu = {"child-runner": child_runner, "parent": total - child_runner, "probe": 0.07,
           "others": 0.01}
    found = {"w1": {"runs_per_s": 1000 / total, "cpu_ms_per_run": cpu,
                    "server_work_per_run": {"nats_msgs_in": 17.7},
                    "correctness": {"ok": ok}},
             "compare": {"exit_code": exit_code, "file": "x.json", "failures": list(failures)}}
    if instructions is not None:
        found["callgrind"] = {"service": "child-runner", "per_run": instructions}
    return found


def test_the_side_that_runs_first_alternates_from_pair_to_pair() -> None:
    assert order(1) == ["A", "B"]
    assert order(3) == ["A", "B", "B", "A", "A", "B"]


def test_each_pair_is_a_ratio_and_the_verdict_their_median() -> None:
    sides = order(3)
    # A B, B A, A B: a machine that slows down as it goes weighs on both sides.
    runs = [result(2.0), result(1.8), result(2.2), result(2.4), result(2.6), result(2.34)]
    summary = summarize(sides, runs)
    assert summary["pair_ratios"] == pytest.approx([0.9, 2.2 / 2.4, 0.9])
    assert summary["median_pair_ratio"] == pytest.approx(0.9)
    rows = {row["figure"]: row for row in summary["rows"]}
    # The probe and the rest of the machine are not the run's CPU.
    assert set(rows) == {"CPU ms per run: child-runner", "CPU ms per run: parent",
                         "CPU ms per run: all", "W1 runs/s", "NATS messages in per run"}
    assert rows["CPU ms per run: all"]["a"] == pytest.approx(2.4)  # median of 2.0, 2.4, 2.6
    assert rows["CPU ms per run: all"]["b"] == pytest.approx(2.2)  # of 1.8, 2.2, 2.34
    assert rows["CPU ms per run: all"]["change"] == pytest.approx(2.2 / 2.4 - 1)
    assert summary["failed"] == []
    assert "median 0.900" in render(summary, "abc", ".")


def test_callgrind_counts_are_compared_when_the_runs_have_them() -> None:
    runs = [result(2.0, instructions=2.07e6), result(2.0, instructions=1.9e6)]
    rows = {row["figure"]: row for row in summarize(order(1), runs)["rows"]}
    row = rows["instructions per run: child-runner"]
    assert (row["a"], row["b"]) == (2.07e6, 1.9e6)
    assert "1.900 M" in render(summarize(order(1), runs), "a", "b")


def test_a_run_that_failed_or_was_not_correct_is_named() -> None:
    runs = [result(2.0), result(2.0, ok=False),
            result(2.0, exit_code=1, failures=("crashed services: parent",)), result(2.0)]
    summary = summarize(order(2), runs)
    assert summary["failed"] == ["B run 1: exit code 0, correct False",
                                 "B run 2: exit code 1, correct True; crashed services: parent"]
    assert "FAILED: B run 1" in render(summary, "a", "b")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_revision_is_taken_out_of_git_as_it_was(tmp_path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for text in ("first", "second"):
        (repo / "file.txt").write_text(text)
        git(repo, "add", "file.txt")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", text)
    tree = materialize("HEAD~1", tmp_path / "trees", repo=repo)
    assert (tree / "file.txt").read_text() == "first"
    assert materialize(".", tmp_path / "unused", repo=repo) == repo
    with pytest.raises(SystemExit, match="'no-such' is not a git revision"):
        materialize("no-such", tmp_path / "trees", repo=repo)


def test_a_run_in_a_taken_out_tree_imports_that_trees_code(tmp_path) -> None:
    """The editable install points at this checkout; the other tree's code must win."""
    tree = materialize("HEAD", tmp_path)
    assert tree != REPO
    code = "import bench, services, tether; print(bench.__file__, services.__file__, tether.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(tree),
                          check=True, capture_output=True, text=True)
    for path in done.stdout.split():
        assert Path(path).is_relative_to(tree), path
