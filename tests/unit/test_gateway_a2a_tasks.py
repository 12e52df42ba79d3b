"""A run in A2A's terms: its task state, words and artifacts."""

import pytest
from a2a.types import TaskState
from google.protobuf.json_format import MessageToDict

from tether.client.timeline import ProgressView, RunView
from tether.contract.messages import MilestoneView, RunSnapshot
from tether.domain.events import ParentRef
from tether.gateway.a2a_tasks import StreamState, a2a_state, task_of, words_of

PARENT = ParentRef(agent="Gateway", name="desktop")


def run(**fields) -> RunSnapshot:
    return RunSnapshot(**{"run_id": "a2a-1", "parent": PARENT, "agent_type": "Researcher",
                          "status": "running", "detached": True, "requested_at": 0,
                          **fields})


@pytest.mark.parametrize(("fields", "state"), [
    ({"status": "starting"}, TaskState.TASK_STATE_SUBMITTED),
    ({"status": "running"}, TaskState.TASK_STATE_WORKING),
    ({"status": "running", "waiting_for": "waiting_for_human"},
     TaskState.TASK_STATE_INPUT_REQUIRED),
    ({"status": "completed"}, TaskState.TASK_STATE_COMPLETED),
    ({"status": "error"}, TaskState.TASK_STATE_FAILED),
    ({"status": "interrupted"}, TaskState.TASK_STATE_FAILED),
    ({"status": "aborted", "cancel_requested": True}, TaskState.TASK_STATE_CANCELED),
    ({"status": "aborted"}, TaskState.TASK_STATE_FAILED),
])
def test_a_runs_status_is_its_tasks_state(fields, state):
    assert a2a_state(run(**fields)) == state


def test_a_task_says_the_runs_progress_its_wait_or_its_outcome():
    assert words_of(run(progress={"message": "reading"},
                        milestones=[MilestoneView(sequence=0, name="found", at=1)])) == \
        "found - reading"
    assert words_of(run(waiting_for="waiting_for_human")) == "waiting for a human's input"
    assert words_of(run(status="error", error="the source is down")) == "the source is down"


def test_a_completed_task_carries_its_output_and_result_and_the_run_in_its_metadata():
    task = task_of(run(status="completed", summary="two sources agree", output={"n": 2},
                       output_text="a b"))
    assert task.id == "a2a-1" and task.context_id == "Gateway/desktop"
    assert [(a.artifact_id, [MessageToDict(p) for p in a.parts]) for a in task.artifacts] == [
        ("output", [{"text": "a b"}]),
        ("result", [{"text": "two sources agree"}, {"data": {"n": 2.0}}])]
    assert MessageToDict(task.metadata)["run_id"] == "a2a-1"
    assert task.status.message.parts[0].text == "two sources agree"


def _message_id(**fields) -> str:
    return task_of(run(**fields)).status.message.message_id


def test_a_status_read_again_is_the_same_message_and_a_new_one_another():
    held = {"progress": {"message": "held", "at": 5}}
    assert _message_id(**held) == _message_id(**held)
    assert _message_id(**held) != _message_id(progress={"message": "held", "at": 9})
    ended = {"status": "completed", "summary": "done", "ended_at": 7}
    assert _message_id(**ended) == _message_id(**ended)
    assert _message_id(**ended) != _message_id(**{**ended, "ended_at": 8})  # a later turn


def test_a_second_pause_asking_the_same_is_another_message():
    pause = {"waiting_for": "waiting_for_human", "pending": [
        {"tool_call_id": "publish", "tool_name": "publish", "reason": "approval"}]}
    first = [MilestoneView(sequence=0, name="needs-approval", at=1)]
    second = [*first, MilestoneView(sequence=1, name="needs-approval", at=2)]
    assert _message_id(**pause, milestones=first) == _message_id(**pause, milestones=first)
    assert _message_id(**pause, milestones=first) != _message_id(**pause, milestones=second)


def test_a_streamed_status_is_the_same_message_as_the_task_read_at_that_moment():
    snapshot = run(progress={"message": "held", "at": 5},
                   milestones=[MilestoneView(sequence=0, name="found", at=1)])
    view = RunView(run_id="a2a-1", agent_type="Researcher", status="running",
                   progress=ProgressView(message="held", at=5, source="signal"),
                   milestones=(MilestoneView(sequence=0, name="found", at=1),),
                   requested_at=0)
    stream = StreamState(state=TaskState.TASK_STATE_SUBMITTED, words="", output=0)
    streamed = stream.status(view, "Gateway/desktop").status.message
    read = task_of(snapshot).status.message
    assert (streamed.message_id, streamed.parts[0].text) == \
        (read.message_id, "found - held")
