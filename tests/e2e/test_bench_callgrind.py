"""`bench --callgrind`: the count covers only what a process did between zero and dump,
and grows with the work done."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.callgrind import Callgrind

pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")

# Busy at start (as a service importing its modules), then does `work N` when told, and
# wakes every 20 ms meanwhile, as a service does, so valgrind takes its commands.
WORKER = """
import select, sys
def spin(n):
    s = 0
    for i in range(n):
        s += i
    return s
spin(1_000_000)
print("ready", flush=True)
while True:
    if not select.select([sys.stdin], [], [], 0.02)[0]:
        continue
    line = sys.stdin.readline()
    if not line:
        break
    spin(int(line.split()[1]))
    print("done", flush=True)
"""


def test_the_count_is_the_work_between_zero_and_dump(tmp_path: Path) -> None:
    callgrind = Callgrind("worker", tmp_path / "worker.callgrind")
    process = subprocess.Popen([*callgrind.command_prefix(), sys.executable, "-c", WORKER],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.DEVNULL)
    try:
        assert process.stdout.readline().strip() == "ready"

        def measured(iterations: int) -> int:
            callgrind.zero(process.pid)
            process.stdin.write(f"work {iterations}\n")
            process.stdin.flush()
            assert process.stdout.readline().strip() == "done"
            return callgrind.dump()

        once, twice = measured(100_000), measured(200_000)
        # Twice the work, twice the count: neither holds the start-up's 1,000,000
        # iterations (with them the two would be within 10 % of each other).
        assert 1.7 < twice / once < 2.3, (once, twice)
        assert len(list(tmp_path.glob("worker.callgrind.*"))) == 2
    finally:
        process.kill()
        process.wait(timeout=30)
