"""`--callgrind SERVICE`: count the instructions one service executes per W1 run.

A shared 2-core machine drifts in speed by 30 % and more within minutes, so two builds'
CPU per run can only be told apart when their difference is larger than that. Valgrind's
callgrind counts instructions instead of seconds: the same build, workload and inputs give
the same count whatever else the machine does (within a percent or two: how the runs
fall into batches still depends on timing).

The service runs under `valgrind --tool=callgrind` (about 50 times slower, so every time
figure of such a run is meaningless); its counters are zeroed when W1 starts and dumped
when it ends (`callgrind_control`), and the dump's total is divided by the finished runs.
The dump itself, for `callgrind_annotate`, is kept beside the results.
"""

import shutil
import subprocess
from pathlib import Path


class Callgrind:
    def __init__(self, service: str, out_file: Path) -> None:
        for tool in ("valgrind", "callgrind_control"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"--callgrind needs {tool} (Debian: apt install valgrind)")
        self.service = service
        self.out_file = out_file
        self.pid: int | None = None

    def command_prefix(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--collect-atstart=yes",
                f"--callgrind-out-file={self.out_file}"]

    def zero(self, pid: int) -> None:
        """W1 starts: what the service did so far (imports, start-up) is not counted."""
        self.pid = pid
        self._control("-z")

    def dump(self) -> int:
        """W1 ended: the instructions executed since `zero`."""
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
