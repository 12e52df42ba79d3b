"""A run's name as a parent, its id at a remote agent, and which chat a run speaks on and
notifies: pure decisions."""

import pytest

from tether.domain import decide
from tether.domain.chat import ChatKey, chat_of, notice_chat, started_by_error
from tether.domain.events import ParentRef, RunRef
from tether.domain.fold import evolve
from tether.domain.ids import check_identifier, nested_parent_name, remote_run_id
from tether.testing import RunEvents

ALICE = ParentRef(agent="Assistant", name="alice")
BOB = ParentRef(agent="Assistant", name="bob")


def state_of(run_id: str, parent: ParentRef, **data):
    return evolve(None, RunEvents(run_id, parent).requested("Planner", **data)).state


def test_one_run_id_of_two_parents_is_two_names_as_parents() -> None:
    names = {nested_parent_name(p.agent, p.name, "research-1") for p in (ALICE, BOB)}

    assert len(names) == 2
    assert all(name.startswith("research-1:") for name in names)
    assert nested_parent_name("Assistant", "alice", "research-1") in names  # stable


def test_a_path_cannot_be_read_two_ways() -> None:
    # `a/b:c` + `d` and `a/b` + `c:d` would read alike without the separators hashed in.
    assert nested_parent_name("A", "b:c", "d") != nested_parent_name("A", "b", "c:d")
    assert nested_parent_name("A:b", "c", "d") != nested_parent_name("A", "b:c", "d")


def test_a_long_run_id_is_cut_to_an_identifier_and_still_named_whole() -> None:
    long = "r" * 128
    name = nested_parent_name("Assistant", "alice", long)
    other = nested_parent_name("Assistant", "alice", long[:-1] + "s")

    assert check_identifier(name) == name and len(name) == 128
    assert name != other


def test_a_runs_remote_id_names_its_parent_and_its_life() -> None:
    ids = {remote_run_id(p.agent, p.name, "research-1", life)
           for p in (ALICE, BOB) for life in ("life-a", "life-b")}

    assert len(ids) == 4
    assert all(run_id.startswith("research-1-") for run_id in ids)
    assert remote_run_id("Assistant", "alice", "research-1", "life-a") in ids  # stable
    long = "r" * 128
    cut = remote_run_id("Assistant", "alice", long, "life-a")
    assert check_identifier(cut) == cut and len(cut) == 128
    assert cut != remote_run_id("Assistant", "alice", long[:-1] + "s", "life-a")


def test_a_run_owns_its_nested_runs_by_its_name_and_speaks_on_its_own_chat() -> None:
    state = state_of("support", ALICE)

    assert state.as_parent() == ParentRef(
        agent="Planner", name=nested_parent_name("Assistant", "alice", "support"))
    assert chat_of(state) == ChatKey(ALICE, "support")


def test_a_run_requested_before_names_by_its_run_id_and_speaks_there() -> None:
    legacy = state_of("support", ALICE, nested_parent="support")

    assert legacy.as_parent() == ParentRef(agent="Planner", name="support")
    assert chat_of(legacy) == ChatKey(ParentRef(agent="Planner", name="support"))


def test_notifications_go_to_the_chat_of_the_run_that_started_it() -> None:
    conversation = state_of("support", ALICE)
    started_by = RunRef(parent=ALICE, run_id="support")
    nested = state_of("agent-tool:call_0_0", conversation.as_parent(), started_by=started_by)
    top = state_of("research-1", ALICE)

    assert notice_chat(nested) == chat_of(conversation) == ChatKey(ALICE, "support")
    assert notice_chat(top) == ChatKey(ALICE)


def test_notifications_of_a_run_started_by_one_requested_before_go_to_its_old_chat() -> None:
    legacy = state_of("support", ALICE, nested_parent="support")
    nested = state_of("agent-tool:call_0_0", legacy.as_parent(),
                      started_by=RunRef(parent=ALICE, run_id="support"))

    assert notice_chat(nested) == chat_of(legacy) == ChatKey(legacy.as_parent())


@pytest.mark.parametrize(("parent_name", "started_by", "refused"), [
    (nested_parent_name("Assistant", "alice", "support"), RunRef(parent=ALICE, run_id="support"),
     False),
    ("support", RunRef(parent=ALICE, run_id="support"), False),  # requested before v3
    (nested_parent_name("Assistant", "alice", "support"), RunRef(parent=BOB, run_id="support"),
     True),
    (nested_parent_name("Assistant", "alice", "support"), RunRef(parent=ALICE, run_id="other"),
     True),
    ("anything", None, False),
], ids=["its-own", "legacy", "another-parent", "another-run", "none"])
def test_a_nested_request_must_come_from_the_run_acting_as_its_parent(
        parent_name: str, started_by: RunRef | None, refused: bool) -> None:
    error = started_by_error(ParentRef(agent="Planner", name=parent_name), started_by)

    assert (error is not None) == refused
    if refused:
        assert "is not the run acting as parent Planner/" in error


def test_a_decision_reaching_a_descendant_has_ids_of_its_own() -> None:
    """Run ids repeat between parents: two descendants `agent-tool:call_0_0` of one cancel
    (or of one reconciler's give-up) get event ids of their own, by their lives."""
    first = state_of("agent-tool:call_0_0", ParentRef(agent="Lead", name="a:1"))
    second = state_of("agent-tool:call_0_0", ParentRef(agent="Lead", name="b:2"))
    command = decide.Cause(command_seq=7, now=1)
    timer = decide.timer_cause(1, "rec-1")

    for cause in (command, timer):
        ids = {decide.cascade(cause, run).event_id(run.run_id, "cancel", run.parent)
               for run in (first, second)}
        assert len(ids) == 2
    assert decide.cascade(command, first).origin == f"cascade-{first.incarnation}"
    assert decide.cascade(timer, first).origin == f"rec-1-cascade-{first.incarnation}"
