"""Text for terminals: one line per run, with a progress bar."""

from tether.client.timeline import RunView, TimelineView

BAR_WIDTH = 20
_FINAL_MARK = {"completed": "done", "error": "FAILED", "aborted": "aborted",
               "interrupted": "interrupted"}


def progress_bar(fraction: float | None, width: int = BAR_WIDTH) -> str:
    if fraction is None:
        return "[" + "·" * width + "]     "
    filled = round(max(0.0, min(fraction, 1.0)) * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction:4.0%}"


def run_line(run: RunView, *, width: int = BAR_WIDTH) -> str:
    progress = run.progress
    fraction = 1.0 if run.status == "completed" else (progress.fraction if progress else None)
    parts = [f"{run.run_id} {run.agent_type:<12} {run.status:<11} {progress_bar(fraction, width)}"]
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
    return " ".join(parts)


def timeline_lines(view: TimelineView) -> list[str]:
    if not view.runs:
        return ["(no runs yet)"]
    lines: list[str] = []
    for tool_call_id in view.tool_call_ids:
        lines.append(f"tool call {tool_call_id}:")
        lines.extend("  " + run_line(run) for run in view.runs_for_tool_call(tool_call_id))
    unbound = view.unbound_runs
    indent = ""
    if unbound and lines:
        lines.append("without a tool call:")
        indent = "  "
    lines.extend(indent + run_line(run) for run in unbound)
    return lines
