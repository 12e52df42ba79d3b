"""py-spy sampling of the service processes during W1, summarised into hot spots.

`py-spy record --format raw` writes collapsed stacks ("frame;frame;... count"), one
line per distinct stack, idle samples excluded. The summary gives, per process, the
functions with the most samples on top of the stack (self) and anywhere in it
(inclusive), so "where does the CPU go" is readable without a flame graph viewer.
"""

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Frames on every stack of a service process (the CLI and the service runner).
ENTRY_FRAMES = ("tether/cli.py:", "tether/runtime.py:")
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


class Profiler:
    def __init__(self, out_dir: Path, rate: int = 67) -> None:
        self.out_dir = out_dir
        self.rate = rate
        self.binary = py_spy()
        self._running: dict[str, tuple[subprocess.Popen, Path]] = {}

    def start(self, pids: dict[str, int]) -> None:
        if self.binary is None:
            raise RuntimeError("py-spy not found: pip install py-spy")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            out = self.out_dir / f"{name}.collapsed.txt"
            # Blocking (the default): each sample pauses the process to read a consistent
            # stack. With --nonblocking, a uvloop service's native callbacks (socket
            # writes, timers) showed as whatever Python frame ran last: half the
            # child-runner's samples were "StreamWriter.writelines", which perf (native
            # stacks) put at 0 %. The pause costs about 1 % at 67 Hz.
            # --gil: only samples where the thread holds the GIL, i.e. runs Python code.
            # Without it, on a saturated 2-core machine most "busy" samples are a process
            # that was preempted (runnable, waiting for a core) at the socket write that
            # woke nats-server or Postgres: scheduling, not the process's own CPU.
            with open(self.out_dir / f"{name}.py-spy.log", "w") as log:
                process = subprocess.Popen(
                    [self.binary, "record", "-p", str(pid), "-r", str(self.rate),
                     "--gil", "-f", "raw", "-o", str(out)],
                    stdout=subprocess.DEVNULL, stderr=log)
            self._running[name] = (process, out)

    def stop(self) -> dict[str, dict]:
        for process, _ in self._running.values():
            process.send_signal(signal.SIGINT)
        summaries = {}
        for name, (process, out) in self._running.items():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            summaries[name] = summarise(out) if out.exists() else {"error": "no profile"}
        return summaries


def short(frame: str) -> str:
    """`func (path/to/site-packages/pkg/mod.py:12)` -> `pkg/mod.py:func`."""
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["file"]
    for marker in ("site-packages/", "libs/", "/lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{match['func']}"


def summarise(path: Path, top: int = 15) -> dict:
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    ours: Counter[str] = Counter()  # inclusive, tether code only
    deepest: Counter[str] = Counter()  # the innermost tether frame: our code + what it calls
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [short(f) for f in stack.split(";")]
        # The first frame is the thread ("process 123:..." / "thread (0x..)") in some modes.
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += n
        self_counts[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
            if frame.startswith("tether/") and not frame.startswith(ENTRY_FRAMES):
                ours[frame] += n
        mine = [f for f in frames if f.startswith("tether/") and not f.startswith(ENTRY_FRAMES)]
        deepest[mine[-1] if mine else "(no tether frame: event loop, nats-py, asyncpg)"] += n

    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / max(total, 1), 1)) for name, n in counter.most_common(top)]

    return {"samples": total, "self_pct": share(self_counts),
            "innermost_tether_pct": share(deepest), "inclusive_tether_pct": share(ours),
            "inclusive_pct": share(inclusive)}


def render(summaries: dict[str, dict], top: int = 8) -> str:
    lines = []
    for name, summary in summaries.items():
        if "error" in summary:
            lines.append(f"{name}: {summary['error']}")
            continue
        lines.append(f"{name}: {summary['samples']} busy samples")
        lines.append("  self:      " + "; ".join(f"{f} {p}%" for f, p in summary["self_pct"][:top]))
        lines.append("  innermost: " + "; ".join(f"{f} {p}%"
                                                 for f, p in summary["innermost_tether_pct"][:top]))
        lines.append("  inclusive: " + "; ".join(f"{f} {p}%"
                                                 for f, p in summary["inclusive_tether_pct"][:top]))
    return "\n".join(lines)
