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
MIN_BAR_WIDTH = 4
FINAL_STATUSES = frozenset({"completed", "error", "aborted", "interrupted"})
_FINAL_MARK = {"completed": "done", "error": "FAILED", "aborted": "aborted",
               "interrupted": "interrupted"}


def progress_bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    if fraction is None:
        return "[" + "·" * width + "]     "
    filled = round(max(0.0, min(fraction, 1.0)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction:4.0%}"


def run_line(run: RunView, *, width: int = BAR_WIDTH, columns: int | None = None) -> str:
    """The agent, the status and the bar, what the child said, and the run id. Within
    `columns` (a terminal's width), what the child said is cut to fit, so the run id
    stays on the line."""
    progress = run.progress
    fraction = 1.0 if run.status == "completed" else (progress.fraction if progress else None)
    tail = f"· {run.run_id}"
    if columns is not None:  # a narrower bar, down to MIN_BAR_WIDTH, before the run id goes
        fitting = columns - (len(run.agent_type) + len(" ") + 11 + len(" [] 100% ") + len(tail))
        if fitting >= MIN_BAR_WIDTH:
            width = min(width, fitting)
    head = f"{run.agent_type} {run.status:<11} {progress_bar(fraction, width)}"
    middle = " ".join(_said(run))
    line = " ".join(part for part in (head, middle, tail) if part)
    if columns is None or len(line) <= columns:
        return line
    room = columns - len(head) - len(tail) - 2
    if room >= 2 and middle:
        return f"{head} {middle[:room - 1]}… {tail}"
    return f"{head} {tail}"  # too narrow for the run id as well: the board cuts its end


def _said(run: RunView) -> list[str]:
    """What the child said of a run, for its line: phase, message, milestones, failure."""
    progress = run.progress
    parts: list[str] = []
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
    return parts


def timeline_rows(view: TimelineView, *, width: int = BAR_WIDTH,
                  columns: int | None = None) -> list[tuple[str, str]]:
    """(key, line) for each line of the view: a run's key is its run id; each fitted to
    `columns` (`run_line`)."""
    def line(run: RunView, indent: str) -> str:
        return indent + run_line(run, width=width,
                                 columns=None if columns is None else columns - len(indent))

    if not view.runs:
        return [("", "(no runs yet)"), *unreadable_rows(view)]
    rows: list[tuple[str, str]] = []
    for tool_call_id in view.tool_call_ids:
        rows.append((f"tool call {tool_call_id}", f"tool call {tool_call_id}:"))
        rows.extend((run.run_id, line(run, "  "))
                    for run in view.runs_for_tool_call(tool_call_id))
    unbound = view.unbound_runs
    indent = ""
    if unbound and rows:
        rows.append(("without a tool call", "without a tool call:"))
        indent = "  "
    rows.extend((run.run_id, line(run, indent)) for run in unbound)
    return rows + unreadable_rows(view)


def unreadable_rows(view: TimelineView) -> list[tuple[str, str]]:
    """A line for each unreadable event the view keeps, after how many more there were:
    something was there, and no run shows it."""
    rows = [(f"unreadable {item.seq}", item.line) for item in view.unreadable]
    earlier = view.unreadable_count - len(view.unreadable)
    if earlier:
        rows.insert(0, ("unreadable earlier", f"{earlier} earlier event{'s' if earlier > 1 else ''} could not be read"))
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
    def columns(self) -> int | None:
        """The terminal's width, which live lines are fitted to; None when piped."""
        return self.console.width if self.tty else None

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
