"""Tether runs as A2A tasks: a run's state, words, artifacts and metadata in A2A's terms,
and what a stream has already sent of one (`StreamState`), so each update says only
what is new."""

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Struct, Value
from google.protobuf.timestamp_pb2 import Timestamp

from tether.client.timeline import RunView
from tether.contract.messages import RunSnapshot
from tether.domain.events import OPEN_STATUSES
from tether.gateway.answers import waiting_words

Event = Task | Message | TaskStatusUpdateEvent | TaskArtifactUpdateEvent
FINAL = frozenset({TaskState.TASK_STATE_COMPLETED, TaskState.TASK_STATE_FAILED,
                   TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED})
STOPS_STREAM = FINAL | {TaskState.TASK_STATE_INPUT_REQUIRED}
OUTPUT_ARTIFACT, RESULT_ARTIFACT = "output", "result"

class StreamState:
    """What a stream has sent of one run, so each update says only what is new."""

    def __init__(self, *, state: TaskState, words: str, output: int) -> None:
        self.state, self.words, self.output = state, words, output
        self.moved = False

    def updates(self, run: RunView, context_id: str,
                pending: Sequence[Mapping[str, Any]] = ()) -> list[Event]:
        """What is new in `run`; `pending`: the calls it waits on (a view does not hold
        them; the run's snapshot does)."""
        events: list[Event] = []
        text = run.output_text
        if len(text) > self.output:
            events.append(TaskArtifactUpdateEvent(
                task_id=run.run_id, context_id=context_id, append=self.output > 0,
                artifact=Artifact(artifact_id=OUTPUT_ARTIFACT, name="output",
                                  parts=[Part(text=text[self.output:])])))
            self.output = len(text)
        state = view_state(run)
        if state not in FINAL and (state != self.state
                                   or viewwords(run, pending) != self.words):
            events.append(self.status(run, context_id, pending=pending))
        return events

    def status(self, run: RunView, context_id: str, *, force: bool = False,
               pending: Sequence[Mapping[str, Any]] = ()) -> TaskStatusUpdateEvent:
        state, words = view_state(run), viewwords(run, pending)
        self.moved = self.moved or state != self.state or words != self.words or force
        self.state, self.words = state, words
        moment = status_moment(state, run.ended_at, len(run.milestones),
                               run.progress.at if run.progress else None)
        return TaskStatusUpdateEvent(task_id=run.run_id, context_id=context_id,
                                     status=task_status(state, words, run.run_id, context_id,
                                                        moment))


# --- runs as tasks --------------------------------------------------------------------

def a2a_state(run: RunSnapshot) -> TaskState:
    return _state(run.status, run.waiting_for, run.cancel_requested)


def view_state(run: RunView) -> TaskState:
    return _state(run.status, run.waiting_for, run.cancel_requested)


def _state(status: str, waiting_for: str | None, cancel_requested: bool) -> TaskState:
    if status == "starting":
        return TaskState.TASK_STATE_SUBMITTED
    if status == "running":
        return (TaskState.TASK_STATE_INPUT_REQUIRED if waiting_for
                else TaskState.TASK_STATE_WORKING)
    if status == "completed":
        return TaskState.TASK_STATE_COMPLETED
    if status == "aborted" and cancel_requested:
        return TaskState.TASK_STATE_CANCELED
    return TaskState.TASK_STATE_FAILED


def a2a_state_name(run: RunSnapshot) -> str:
    return TaskState.Name(a2a_state(run)).removeprefix("TASK_STATE_").lower()


def is_final(run: RunSnapshot) -> bool:
    return a2a_state(run) in FINAL


def words_of(run: RunSnapshot) -> str:
    return words(run.status, run.waiting_for, run.pending, run.error or run.summary,
                  (run.progress or {}).get("message"),
                  run.milestones[-1].name if run.milestones else None)


def viewwords(run: RunView, pending: Sequence[Mapping[str, Any]] = ()) -> str:
    return words(run.status, run.waiting_for, pending, run.error or run.summary,
                  run.progress.message if run.progress else None,
                  run.milestones[-1].name if run.milestones else None)


def words(status: str, waiting_for: str | None, pending: Sequence[Mapping[str, Any]],
          outcome: str | None, message: str | None, milestone: str | None) -> str:
    """A task status's message: the outcome, what the run waits for, or its progress."""
    if status not in OPEN_STATUSES:
        return outcome or ""
    if waiting_for:
        return f"waiting for {waiting_words(waiting_for, pending)}"
    return " - ".join(word for word in (milestone, message) if word)


def task_of(run: RunSnapshot) -> Task:
    context_id = context_id_of(run)
    state = a2a_state(run)
    moment = status_moment(state, run.ended_at, len(run.milestones),
                           (run.progress or {}).get("at"))
    task = Task(id=run.run_id, context_id=context_id,
                status=task_status(state, words_of(run), run.run_id, context_id, moment))
    if run.output_text:
        task.artifacts.append(Artifact(artifact_id=OUTPUT_ARTIFACT, name="output",
                                       parts=[Part(text=run.output_text)]))
    if run.status == "completed":
        task.artifacts.append(result_artifact(run))
    metadata: dict[str, Any] = {"run_id": run.run_id, "agent_type": run.agent_type,
                                "milestones": [m.name for m in run.milestones]}
    if run.waiting_for:
        metadata["pending"] = run.pending
    if run.reason:
        metadata["reason"] = run.reason
    task.metadata.CopyFrom(as_struct(metadata))
    return task


def result_artifact(run: RunSnapshot) -> Artifact:
    parts = [Part(text=run.summary or "")]
    if run.output is not None:
        parts.append(Part(data=ParseDict(run.output, Value())))
    return Artifact(artifact_id=RESULT_ARTIFACT, name="result", parts=parts)


def task_status(state: TaskState, words: str, task_id: str, context_id: str,
                moment: str = "") -> TaskStatus:
    status = TaskStatus(state=state)
    status.timestamp.CopyFrom(now_stamp())
    if words:
        status.message.CopyFrom(Message(
            role=Role.ROLE_AGENT, message_id=status_message_id(task_id, state, words, moment),
            task_id=task_id, context_id=context_id, parts=[Part(text=words)]))
    return status


def status_message_id(task_id: str, state: TaskState, words: str, moment: str) -> str:
    """The id of a task's status message, made from what it says and when the run came
    to say it: read again, streamed, or read through another gateway, the same status is
    the same message, so a client that deduplicates by message id shows it once; the
    same words said again later (`moment`) are another message."""
    said = "\0".join((task_id, TaskState.Name(state), words, moment))
    return f"status-{hashlib.sha256(said.encode()).hexdigest()[:32]}"


def status_moment(state: TaskState, ended_at: int | None, milestones: int,
                  progress_at: int | None) -> str:
    """When a run came to its status, from what a snapshot and a timeline view both
    hold: its end; for a pause, its milestones (each pause adds one, so a second pause
    with the same words is another message); else its milestones and its progress report
    (a persisted report keeps the time of the signal it persists)."""
    if state in FINAL:
        return f"ended:{ended_at}"
    if state == TaskState.TASK_STATE_INPUT_REQUIRED:
        return f"milestones:{milestones}"
    return f"milestones:{milestones}:progress:{progress_at}"


def now_stamp() -> Timestamp:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return stamp


def as_struct(value: dict[str, Any]) -> Struct:
    return ParseDict(value, Struct())


def context_id_of(run: RunSnapshot) -> str:
    return f"{run.parent.agent}/{run.parent.name}"
