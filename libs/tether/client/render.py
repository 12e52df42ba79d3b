"""Text for terminals: one line per run, with a progress bar, and a board that redraws them.

On a terminal the board redraws its lines in place with rich, each cut to the terminal's
width (a line wider than the terminal would wrap, and the redraw would leave its first
rows behind); piped, it prints each run's line once per change instead.
"""

from typing import Self, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from tether.client.timeline import RunView, TimelineView

BAR_WIDTH = 20
NARROW_BAR_WIDTH = 10
NARROW_COLUMNS = 80
FINAL_STATUSES = frozenset({"completed", "error", "aborted", "interrupted"})
_FINAL_MARK = {"completed": "done", "error": "FAILED", "aborted": "aborted",
               "interrupted": "interrupted"}


def progress_bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    if fraction is None:
        return "[" + "·" * width + "]     "
    filled = round(max(0.0, min(fraction, 1.0)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction:4.0%}"


def run_line(run: RunView, *, width: int = BAR_WIDTH) -> str:
    """What matters first, so a line cut to a narrow terminal keeps it: the agent, the
    status and the bar, then what the child said, then the run id."""
    progress = run.progress
    fraction = 1.0 if run.status == "completed" else (progress.fraction if progress else None)
    parts = [f"{run.agent_type} {run.status:<11} {progress_bar(fraction, width)}"]
    if progress is not None:
        if progress.phase:
            parts.append(f"{progress.phase}:")
        if progress.message:
            parts.append(progress.message)
    if run.milestones:
        parts.append("· milestones: " + ", ".join(m.name for m in run.milestones))
    if run.status in _FINAL_MARK and run.status != "completed":
        detail = run.error or ""
        if run.reason:
            detail = f"{detail} (reason {run.reason})".strip()
        parts.append(f"· {_FINAL_MARK[run.status]}: {detail}")
    parts.append(f"· {run.run_id}")
    return " ".join(parts)


def timeline_rows(view: TimelineView, *, width: int = BAR_WIDTH) -> list[tuple[str, str]]:
    """(key, line) for each line of the view: a run's key is its run id."""
    if not view.runs:
        return [("", "(no runs yet)")]
    rows: list[tuple[str, str]] = []
    for tool_call_id in view.tool_call_ids:
        rows.append((f"tool call {tool_call_id}", f"tool call {tool_call_id}:"))
        rows.extend((run.run_id, "  " + run_line(run, width=width))
                    for run in view.runs_for_tool_call(tool_call_id))
    unbound = view.unbound_runs
    indent = ""
    if unbound and rows:
        rows.append(("without a tool call", "without a tool call:"))
        indent = "  "
    rows.extend((run.run_id, indent + run_line(run, width=width)) for run in unbound)
    return rows


def timeline_lines(view: TimelineView, *, width: int = BAR_WIDTH) -> list[str]:
    return [line for _, line in timeline_rows(view, width=width)]


class Board:
    """Live lines at the bottom of a terminal, with messages printed above them.

    Not on a terminal (a pipe, CI), `show` prints each line that changed once, and `say`
    prints its message; nothing is redrawn. Use it as a context manager: leaving it draws
    the last frame for good.
    """

    def __init__(self, file: TextIO, *, console: Console | None = None) -> None:
        self.console = console or Console(file=file, highlight=False, soft_wrap=False)
        self.tty = self.console.is_terminal
        self._live = (Live(console=self.console, auto_refresh=False, transient=False,
                           redirect_stdout=False, redirect_stderr=False)
                      if self.tty else None)
        self._printed: dict[str, str] = {}

    @property
    def bar_width(self) -> int:
        return NARROW_BAR_WIDTH if self.console.width < NARROW_COLUMNS else BAR_WIDTH

    def __enter__(self) -> Self:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._live is not None:
            self._live.stop()

    def show(self, rows: list[tuple[str, str]]) -> None:
        """Draw these (key, line) rows; piped, print the rows whose line changed."""
        if self._live is not None:
            self._live.update(Group(*(_fitted(line) for _, line in rows)), refresh=True)
            return
        for key, line in rows:
            if self._printed.get(key) != line:
                self._printed[key] = line
                self.console.print(Text(line), soft_wrap=True)

    def say(self, text: str) -> None:
        # Above the live lines on a terminal: rich moves them down.
        self.console.print(Text(text), soft_wrap=not self.tty)
        if self._live is not None:
            self._live.refresh()


def _fitted(line: str) -> Text:
    return Text(line, no_wrap=True, overflow="ellipsis")
