"""A run's line on a terminal: fitted to its width, what the child said is cut before the
run id is."""

from tether.client.feed import UnreadableEvent
from tether.client.render import run_line, timeline_lines
from tether.client.timeline import TimelineView, run_view
from tether.contract.messages import ProgressSignal
from tether.domain.events import ParentRef
from tether.domain.fold import evolve
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


def running(run_id: str, message: str):
    run = RunEvents(run_id, PARENT)
    state = None
    for event in (run.requested(), run.running()):
        state = evolve(state, event).state
    signal = ProgressSignal(run_id=run_id, parent=PARENT, fraction=0.5, phase="reading",
                            message=message, at=2_000)
    return run_view(state, signal)


def test_piped_a_line_says_everything():
    line = run_line(running("r-1", "x" * 200))
    assert line.endswith("x · r-1") and len(line) > 200


def test_at_eighty_columns_the_message_is_cut_and_the_run_id_kept():
    line = run_line(running("research-7", "3 of 6 sources " * 10), columns=80)
    assert len(line) == 80
    assert line.endswith("… · research-7")
    assert line.startswith("Researcher running     [##########----------]  50% reading: 3 of")


def test_a_narrow_terminal_narrows_the_bar_before_the_run_id_goes():
    narrower = run_line(running("research-with-a-long-id", "m"), columns=70)
    assert narrower == "Researcher running     [#######-------]  50% · research-with-a-long-id"
    assert len(narrower) == 70
    # Too narrow for a bar of MIN_BAR_WIDTH and the run id: the bar, and the end of the
    # run id is what the terminal cuts.
    line = run_line(running("research-with-a-rather-long-run-id-0", "m"), width=10, columns=60)
    assert line == ("Researcher running     [#####-----]  50% · "
                    "research-with-a-rather-long-run-id-0")


def test_unreadable_events_are_listed_after_the_runs_with_how_many_more_there_were():
    unreadable = tuple(UnreadableEvent(seq, "p.evt.Assistant.user-1.r-1", "not JSON")
                       for seq in (8, 9))
    view = TimelineView({"r-1": running("r-1", "m")}, unreadable=unreadable,
                        unreadable_count=5)
    assert timeline_lines(view)[1:] == ["3 earlier events could not be read",
                                        "event at seq 8 could not be read: not JSON",
                                        "event at seq 9 could not be read: not JSON"]
    alone = TimelineView({}, unreadable=unreadable[1:], unreadable_count=1)
    assert timeline_lines(alone) == ["(no runs yet)", "event at seq 9 could not be read: not JSON"]
