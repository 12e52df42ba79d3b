"""`--callgrind SERVICE`: count the instructions one service executes per W1 run.

A shared 2-core machine drifts in speed by 30 % and more within minutes, so two builds'
CPU per run can only be told apart when their difference is larger than that. Valgrind's
callgrind counts instructions instead of seconds: the same build, workload and inputs give
the same count whatever else the machine does (within a percent or two: how the runs
fall into batches still depends on timing).

The service runs under `valgrind --tool=callgrind` (about 50 times slower, so every time
figure of such a run is meaningless); its counters are zeroed when W1 starts and dumped
once W1 has ended and the service has gone quiet (`callgrind_control`), and the dump's
total is divided by the finished runs. Slowed down that much, a follower of the log (the
reconciler) is still working through W1's events when the last run finishes: the dump
waits until the service has used less than `QUIET_SHARE` of a core for `QUIET_S`, so its
count covers all of W1's work. The dump itself, for `callgrind_annotate`, is kept beside
the results.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

QUIET_S = 2.0  # a window of this length with less than QUIET_SHARE of a core: quiet
QUIET_SHARE = 0.15
QUIET_TIMEOUT_S = 300.0


class Callgrind:
    def __init__(self, service: str, out_file: Path) -> None:
        for tool in ("valgrind", "callgrind_control"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"--callgrind needs {tool} (Debian: apt install valgrind)")
        self.service = service
        self.out_file = out_file
        self.pid: int | None = None
        self.quiet_after_s = 0.0  # how long after W1 the service went quiet

    def command_prefix(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--collect-atstart=yes",
                f"--callgrind-out-file={self.out_file}"]

    def zero(self, pid: int) -> None:
        """W1 starts: what the service did so far (imports, start-up) is not counted."""
        self.pid = pid
        self._control("-z")

    def dump(self) -> int:
        """W1 ended: the instructions executed since `zero`, once the service is quiet."""
        self.quiet_after_s = wait_quiet(self.pid)
        before = set(self.out_file.parent.glob(self.out_file.name + ".*"))
        self._control("-d")
        dumps = sorted(set(self.out_file.parent.glob(self.out_file.name + ".*")) - before)
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump for {self.service} (pid {self.pid})")
        return instructions(dumps[-1])

    def _control(self, flag: str) -> None:
        # Valgrind looks for commands between basic blocks: an idle service takes them
        # at its next wake-up, at most a fetch timeout away.
        subprocess.run(["callgrind_control", flag, str(self.pid)], check=True,
                       capture_output=True, timeout=120)


def instructions(dump: Path) -> int:
    """The `summary:` (or `totals:`) line of a callgrind dump: instructions executed."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {dump}")


def cpu_seconds(pid: int) -> float:
    """User and system time of a process so far (`/proc/<pid>/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int | None, *, window_s: float = QUIET_S, share: float = QUIET_SHARE,
               timeout_s: float = QUIET_TIMEOUT_S) -> float:
    """Block until the process used less than `share` of a core over `window_s`; the
    seconds that took."""
    if pid is None:
        return 0.0
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = cpu_seconds(pid)
        time.sleep(window_s)
        if cpu_seconds(pid) - before < share * window_s:
            break
    return time.monotonic() - started - window_s
