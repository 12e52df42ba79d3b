"""Noticing a blocked event loop, and the child that blocked it.

Every service of a process shares one event loop: a child agent that calls blocking code
(`time.sleep`, a synchronous HTTP client, a long computation) stops every other run, the
heartbeats and, in `tether services all`, the other services too, with no error
anywhere. `LoopWatch` keeps a timestamp the loop refreshes every `beat_s`, and a thread
that looks at it: once the loop has not run for `warn_after_s`, it logs
`event_loop.blocked` with the task the loop is running — a child's (`child_task_name`)
names its run and agent type — and where the loop's thread stands (the file, line and
function of its innermost frame outside the standard library and installed packages:
the call into blocking code), and `event_loop.unblocked` with how long it lasted when
the loop runs again.
"""

import asyncio
import sys
import sysconfig
import threading
import time
from contextlib import suppress
from types import FrameType

from tether.metrics import LOOP_BLOCKED

CHILD_TASK_PREFIX = "child:"


def child_task_name(agent_type: str, run_id: str) -> str:
    """The name of the task that runs a child's turn: `child:<agent type>/<run id>`."""
    return f"{CHILD_TASK_PREFIX}{agent_type}/{run_id}"


def _child_of(task_name: str) -> tuple[str, str] | None:
    """(agent type, run id) of a child's task name; None for any other task."""
    if not task_name.startswith(CHILD_TASK_PREFIX):
        return None
    agent_type, _, run_id = task_name.removeprefix(CHILD_TASK_PREFIX).partition("/")
    return (agent_type, run_id) if run_id else None


# Where the standard library and installed packages are: blocking code, not the call.
_LIBRARIES = tuple({sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib",
                                                          "platlib")})


def _where(frame: FrameType) -> str:
    """The innermost frame outside the libraries, from `frame` (the thread's innermost)."""
    found: FrameType | None = frame
    while found is not None and found.f_code.co_filename.startswith(_LIBRARIES):
        found = found.f_back
    found = found or frame
    code = found.f_code
    return f"{code.co_filename}:{found.f_lineno} in {code.co_name}"


class LoopWatch:
    def __init__(self, loop: asyncio.AbstractEventLoop, logger, *, warn_after_s: float,
                 beat_s: float | None = None) -> None:
        self._loop, self._logger = loop, logger
        self._warn_after_s = warn_after_s
        self._beat_s = beat_s if beat_s is not None else min(warn_after_s / 4, 0.25)
        self._beat_at = time.monotonic()
        self._blocked_since: float | None = None  # set by the thread, cleared by the loop
        self._stopped = threading.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._loop_thread: int | None = None
        self._thread = threading.Thread(target=self._watch, name="tether-loop-watch",
                                        daemon=True)

    def start(self) -> None:
        """In the loop's thread."""
        self._loop_thread = threading.get_ident()
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._timer is not None:
            self._timer.cancel()
        self._thread.join(timeout=self._beat_s * 4)

    def _beat(self) -> None:
        now = time.monotonic()
        if (since := self._blocked_since) is not None:
            self._blocked_since = None
            self._logger.warning("event_loop.unblocked", blocked_ms=round((now - since) * 1000))
        self._beat_at = now
        self._timer = self._loop.call_later(self._beat_s, self._beat)

    def _watch(self) -> None:
        while not self._stopped.wait(self._beat_s):
            beat_at = self._beat_at
            late = time.monotonic() - beat_at
            if late >= self._warn_after_s and self._blocked_since is None:
                self._blocked_since = beat_at
                self._report(late)

    def _report(self, late: float) -> None:
        fields: dict[str, object] = {"blocked_ms": round(late * 1000)}
        task = None
        with suppress(RuntimeError):  # the loop's task table changed under the look
            task = asyncio.current_task(self._loop)
        child = None
        if task is not None:
            fields["task"] = task.get_name()
            child = _child_of(task.get_name())
        # sys._current_frames is documented (sys), the one way to see another thread's frame.
        frames = sys._current_frames()  # noqa: SLF001
        if (frame := frames.get(self._loop_thread or 0)) is not None:
            fields["where"] = _where(frame)
        if child is not None:
            fields["agent_type"], fields["run_id"] = child
            fields["hint"] = ("the child runs blocking code on the event loop: await "
                              "asyncio.to_thread(...) for it")
        LOOP_BLOCKED.inc(agent_type=child[0] if child is not None else "")
        self._logger.warning("event_loop.blocked", **fields)
