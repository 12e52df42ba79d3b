"""The benchmark's CPU meter counts a process's CPU time exactly, not in clock ticks: a
service that used less than a tick (10 ms) in a short W1 is not reported as idle."""

import os
import subprocess
import sys
import time

import pytest

from bench.stack import CpuMeter, cpu_seconds

# Says it is ready (its start-up, tens of milliseconds of CPU, over), waits for a line,
# spends `BURN` seconds of its own CPU time, prints how much it spent doing so by its own
# clock, and waits for a line again before it ends.
CHILD = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < float(sys.argv[1]):
    pass
print(time.process_time() - start, flush=True)
sys.stdin.readline()
"""
BURN = 0.004  # less than one clock tick


@pytest.fixture
def burner():
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(BURN)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_a_process_using_less_than_a_tick_is_measured(burner):
    assert burner.stdout.readline() == "ready\n"
    meter = CpuMeter({"burner": [burner.pid]})
    meter.start()
    burner.stdin.write("go\n")
    burner.stdin.flush()
    spent = float(burner.stdout.readline())
    used = meter.stop()
    assert spent >= BURN
    # What it spent, and reading and writing a line on top: far less than 50 ms.
    assert spent <= used["burner"] < spent + 0.05
    assert 0.0 <= used["kernel:burner"] <= used["burner"]
    assert "ticks:burner" not in used
    assert used["others"] >= 0.0


def test_the_meter_reads_a_running_process_as_it_reads_itself():
    before = time.process_time()
    mine = cpu_seconds(os.getpid())
    after = time.process_time()
    assert before <= mine <= after
