"""Time comes from one clock: `tether.ports.Clock`. No module reads the wall clock but the
port's `SystemClock` (the broker's clock samples it through the port too)."""

import ast
from pathlib import Path

import tether
from tether.ports import SYSTEM_CLOCK
from tether.testing import FakeClock

ROOT = Path(tether.__file__).parent
WALL_CLOCK_READS = {("time", "time"), ("time", "time_ns"), ("datetime", "now"),
                    ("datetime", "utcnow"), ("datetime", "today"), ("date", "today")}


def _wall_clock_reads(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        reads = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                 and (node.value.id, node.attr) in WALL_CLOCK_READS)
        imports = (isinstance(node, ast.ImportFrom) and node.module == "time"
                   and any(alias.name in ("time", "time_ns") for alias in node.names))
        if reads or imports:
            lines.append(node.lineno)
    return lines


def test_no_module_reads_the_wall_clock_but_the_clock_port():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(ROOT.rglob("*.py"))
             for line in _wall_clock_reads(path.read_text())]
    assert found == ["ports.py:" + str(_wall_clock_reads((ROOT / "ports.py").read_text())[0])]


def test_the_finder_sees_each_way_of_reading_the_wall_clock():
    assert _wall_clock_reads("import time\nx = time.time()\ny = time.time_ns()\n") == [2, 3]
    assert _wall_clock_reads("from time import time_ns\n") == [1]
    assert _wall_clock_reads("from datetime import datetime\nd = datetime.now()\n") == [2]
    assert _wall_clock_reads("import time\nx = time.monotonic()\n") == []


def test_a_fake_clock_moves_only_when_told():
    clock = FakeClock(now=1_000)
    assert clock.now() == clock.now() == 1_000
    clock.advance(250)
    assert clock.now() == 1_250


def test_the_system_clock_reads_epoch_milliseconds():
    assert 1_700_000_000_000 < SYSTEM_CLOCK.now() < 4_000_000_000_000
