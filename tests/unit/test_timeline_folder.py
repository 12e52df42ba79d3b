"""The timeline's fold: events in, run views out, each view built once per batch."""

import pytest

from tether.client import timeline
from tether.client.timeline import TimelineFolder
from tether.domain.events import ParentRef
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


def test_a_run_of_many_output_chunks_builds_its_view_once_per_view_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's view holds all its output: built at every chunk, reading a run of 10,000
    chunks cost n² (seconds with the loop blocked, a quarter of a minute at 20,000)."""
    built: list[str] = []
    build = timeline.run_view

    def counted(state, signal):  # type: ignore[no-untyped-def]
        built.append(state.run_id)
        return build(state, signal)

    monkeypatch.setattr(timeline, "run_view", counted)
    run = RunEvents("chatty", PARENT)
    folder = TimelineFolder()
    for event in (run.requested(), run.running(), *(run.output(f"{i} ") for i in range(2_000))):
        folder.apply_event(event)
    view = folder.view()
    assert built == ["chatty"], "one view built for the whole batch"
    assert view.changed == {"chatty"}
    assert view.runs["chatty"].output_text == "".join(f"{i} " for i in range(2_000))
    assert folder.view().changed == frozenset(), "nothing changed since the last view"
    assert built == ["chatty"], "nothing folded since: nothing built again"
