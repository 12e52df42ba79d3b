"""What a run waits for when a run below it waits: a nested run paused for a human or
for tool output is relayed up the tree in each ancestor's progress (`phase` the reason,
`data.waiting_path` the runs down to the paused one)."""

from typing import Any, get_args

from tether.domain.events import RunPausedData

WAITING_PHASES: tuple[str, ...] = get_args(RunPausedData.__annotations__["reason"])


def waiting_below(phase: str | None, data: Any) -> tuple[str | None, tuple[dict[str, str], ...]]:
    """The reason and path of a descendant's pause, read off a progress report; (None, ())
    when the report relays none."""
    if phase not in WAITING_PHASES or not isinstance(data, dict):
        return None, ()
    path = data.get("waiting_path")
    if not isinstance(path, list) or not path:
        return None, ()
    return phase, tuple(dict(step) for step in path if isinstance(step, dict))
