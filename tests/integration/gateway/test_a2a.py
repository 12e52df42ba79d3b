"""The gateway's A2A side against the official SDK's client, over real HTTP, with the
parent service and a child-runner on real NATS: each task is a durable Tether run, and a
stream read again after a gateway restart misses nothing and repeats nothing."""

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import gateway_agents
import httpx
import pytest
from a2a.client.errors import A2AClientError
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import A2AError
from eventually import eventually
from gateway_stack import AGENTS, DESKTOP_PARENT, LIMITED, a2a_client, running_gateway
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.struct_pb2 import Value

from tether.agent_registry import AgentRegistry
from tether.gateway import a2a_agents
from tether.generate.gateway import generate as gateway_documents
from tether.parent.service import ParentService


@pytest.fixture
async def base(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as mcp_url:
        yield mcp_url.removesuffix("/mcp")


def message(*, text: str | None = None, data: dict[str, Any] | None = None,
            task_id: str = "", message_id: str | None = None) -> SendMessageRequest:
    part = Part(text=text) if text is not None else Part(data=ParseDict(data, Value()))
    return SendMessageRequest(message=Message(
        role=Role.ROLE_USER, message_id=message_id or uuid.uuid4().hex, parts=[part],
        task_id=task_id))


def described(response) -> tuple[str, Any]:
    kind = response.WhichOneof("payload")
    if kind == "task":
        return "task", TaskState.Name(response.task.status.state)
    if kind == "status_update":
        return "status", TaskState.Name(response.status_update.status.state)
    if kind == "artifact_update":
        update = response.artifact_update
        return "artifact", (update.artifact.artifact_id, update.append,
                            [MessageToDict(part) for part in update.artifact.parts])
    return kind, None


def _output_of(response) -> str:
    """The run's output a stream's response brings: a task's whole output artifact, or an
    output artifact update's new piece."""
    kind = response.WhichOneof("payload")
    artifacts = (response.task.artifacts if kind == "task" else
                 [response.artifact_update.artifact] if kind == "artifact_update" else [])
    return "".join(part.text for artifact in artifacts if artifact.artifact_id == "output"
                   for part in artifact.parts)


async def _collect(stream) -> list:
    return [response async for response in stream]


async def test_each_agent_type_has_a_card_anyone_may_read(base):
    async with httpx.AsyncClient() as http:
        card = (await http.get(f"{base}/a2a/Researcher/.well-known/agent-card.json")).json()
        refused = await http.post(f"{base}/a2a/Researcher/jsonrpc", json={})
    assert card["name"] == "Researcher"
    assert card["description"] == "Looks a question up and says what it found"
    assert card["capabilities"]["streaming"] is True
    assert card["skills"][0]["id"] == "Researcher"
    assert {i["protocolBinding"]: i["url"] for i in card["supportedInterfaces"]} == {
        "JSONRPC": f"{base}/a2a/Researcher/jsonrpc",
        "HTTP+JSON": f"{base}/a2a/Researcher/rest"}
    assert "bearer" in card["securitySchemes"]
    assert refused.status_code == 401
    # What `make schemas` checks in is what the gateway serves.
    assert card == gateway_documents(AgentRegistry(AGENTS), base)[
        "a2a/Researcher.agent-card.json"]


async def test_a_streamed_message_is_a_run_from_submitted_to_completed(base, log):
    # The run is held until the stream has begun: a run that ends before the gateway
    # first reads it is streamed as its final task alone.
    async with a2a_client(base, "HeldResearcher") as client:
        stream = client.send_message(message(text="HTTP/3"))
        events = [await anext(stream)]
        gateway_agents.RELEASE.set()
        events += await _collect(stream)
        first = events[0].task
        task = await client.get_task(GetTaskRequest(id=first.id))

        async def listed() -> bool:  # once the projector has it
            return first.id in [t.id for t in (await client.list_tasks(ListTasksRequest())).tasks]

        await eventually(listed)
    kinds = [described(event) for event in events]
    assert kinds[0] in {("task", "TASK_STATE_SUBMITTED"), ("task", "TASK_STATE_WORKING")}
    assert kinds[-1] == ("status", "TASK_STATE_COMPLETED")
    assert ("artifact", ("result", False, [{"text": "HTTP/3: two sources agree"}])) in kinds
    assert first.context_id == "Gateway/desktop"
    assert TaskState.Name(task.status.state) == "TASK_STATE_COMPLETED"
    assert [a.artifact_id for a in task.artifacts] == ["result"]
    history = await log.read_run(DESKTOP_PARENT, first.id)
    assert history.state.agent_type == "HeldResearcher" and history.state.status == "completed"


async def test_a_message_sent_again_is_the_same_task_and_one_run(base, log):
    again = uuid.uuid4().hex
    async with a2a_client(base, "Researcher") as client:
        one = await _collect(client.send_message(message(data={"query": "once"},
                                                         message_id=again)))
        two = await _collect(client.send_message(message(data={"query": "once"},
                                                         message_id=again)))
    assert one[0].task.id == two[0].task.id
    events = [e.type for e in (await log.read_run(DESKTOP_PARENT, one[0].task.id)).events]
    assert events.count("run.running") == 1


async def test_a_resubscription_after_a_gateway_restart_misses_nothing_and_repeats_nothing(
        services, gateway_settings):
    async with running_gateway(gateway_settings) as mcp_url:
        base = mcp_url.removesuffix("/mcp")
        async with a2a_client(base, "Streamer") as client:
            stream = client.send_message(message(data={}))
            task_id, output = "", ""
            async for response in stream:  # cut off once the first piece arrived
                task_id = task_id or response.task.id
                output += _output_of(response)
                if output:
                    break
            await stream.aclose()
    assert output == "first piece. "
    async with running_gateway(gateway_settings) as mcp_url:
        base = mcp_url.removesuffix("/mcp")
        async with a2a_client(base, "Streamer") as client:
            stream = client.subscribe(SubscribeToTaskRequest(id=task_id))
            snapshot = await anext(stream)
            assert [MessageToDict(p) for p in snapshot.task.artifacts[0].parts] == [
                {"text": "first piece. "}]
            gateway_agents.RELEASE.set()
            rest = [described(response) async for response in stream]
    pieces = [value for kind, value in rest if kind == "artifact" and value[0] == "output"]
    assert pieces == [("output", True, [{"text": "second piece."}])], "each piece once"
    assert ("artifact", ("result", False, [{"text": "streamed"}])) in rest
    assert rest[-1] == ("status", "TASK_STATE_COMPLETED")


async def test_input_required_is_answered_by_a_message_on_the_task(base):
    async with a2a_client(base, "Approver") as client:
        waiting = await _collect(client.send_message(message(data={})))
        assert described(waiting[-1]) in {("status", "TASK_STATE_INPUT_REQUIRED"),
                                          ("task", "TASK_STATE_INPUT_REQUIRED")}
        task_id = waiting[0].task.id
        pending = MessageToDict((await client.get_task(GetTaskRequest(id=task_id))).metadata)
        assert pending["pending"][0]["tool_call_id"] == "publish"
        answered = await _collect(client.send_message(message(
            data={"approvals": ["publish"]}, task_id=task_id)))
    assert described(answered[-1]) == ("status", "TASK_STATE_COMPLETED")
    assert ("artifact", ("result", False, [{"text": "published"}])) in [
        described(a) for a in answered]


async def test_an_answer_that_returns_at_once_returns_the_task_past_its_question(base):
    """The task a client gets back for its answer has taken the answer: one that still
    showed the question would have the client ask its human again."""
    async with a2a_client(base, "Approver", streaming=False) as client:
        [waiting] = await _collect(client.send_message(message(data={})))
        assert described(waiting) == ("task", "TASK_STATE_INPUT_REQUIRED")
        [answered] = await _collect(client.send_message(SendMessageRequest(
            message=message(data={"approvals": ["publish"]}, task_id=waiting.task.id).message,
            configuration=SendMessageConfiguration(return_immediately=True))))
        assert described(answered) in {("task", "TASK_STATE_WORKING"),
                                       ("task", "TASK_STATE_COMPLETED")}

        async def completed():
            task = await client.get_task(GetTaskRequest(id=waiting.task.id))
            return task.status.state == TaskState.TASK_STATE_COMPLETED

        await eventually(completed, timeout=10)


async def test_an_answer_that_returns_at_once_waits_a_bounded_time_for_a_slow_parent(
        base, monkeypatch):
    """A parent service that has not applied the answer within the gateway's wait: the
    task comes back as it is, still asking, and the answer is applied later all the
    same."""
    monkeypatch.setattr(a2a_agents, "ANSWER_TAKEN_WAIT_S", 0.5)
    release = asyncio.Event()
    handle = ParentService._handle

    async def slow_continue(self, msg, *args):
        if msg.subject.split(".")[2] == "continue":
            await release.wait()  # a parent stuck before it applies the answer
        return await handle(self, msg, *args)

    monkeypatch.setattr(ParentService, "_handle", slow_continue)
    async with a2a_client(base, "Approver", streaming=False) as client:
        [waiting] = await _collect(client.send_message(message(data={})))
        [answered] = await asyncio.wait_for(_collect(client.send_message(SendMessageRequest(
            message=message(data={"approvals": ["publish"]}, task_id=waiting.task.id).message,
            configuration=SendMessageConfiguration(return_immediately=True)))), timeout=10)
        assert described(answered) == ("task", "TASK_STATE_INPUT_REQUIRED")
        release.set()

        async def completed():
            task = await client.get_task(GetTaskRequest(id=waiting.task.id))
            return task.status.state == TaskState.TASK_STATE_COMPLETED

        await eventually(completed, timeout=10)


async def test_a_cancelled_task_is_canceled(base):
    async with a2a_client(base, "Waiter", streaming=False) as client:
        started = await _collect(client.send_message(SendMessageRequest(
            message=message(data={}).message,
            configuration=SendMessageConfiguration(return_immediately=True))))
        task_id = started[0].task.id
        assert described(started[0]) in {("task", "TASK_STATE_SUBMITTED"),
                                          ("task", "TASK_STATE_WORKING")}
        cancelled = await client.cancel_task(CancelTaskRequest(id=task_id))
    assert TaskState.Name(cancelled.status.state) == "TASK_STATE_CANCELED"


async def test_a_caller_sees_only_its_own_tasks_and_agents_and_a_stranger_nothing(base):
    async with a2a_client(base, "Researcher") as client:
        mine = await _collect(client.send_message(message(text="mine")))
    async with a2a_client(base, "Researcher", LIMITED) as other:
        with pytest.raises(A2AError):
            await other.get_task(GetTaskRequest(id=mine[0].task.id))
        assert mine[0].task.id not in [t.id for t in (await other.list_tasks(
            ListTasksRequest())).tasks]
    async with a2a_client(base, "Waiter", LIMITED) as other:
        with pytest.raises(A2AError):
            await _collect(other.send_message(message(data={})))
    with pytest.raises(A2AClientError):
        async with a2a_client(base, "Researcher", "not-a-caller") as stranger:
            await stranger.get_task(GetTaskRequest(id=mine[0].task.id))


async def test_an_input_the_agent_refuses_is_a_rejected_task_that_reads_back(base):
    async with a2a_client(base, "Researcher") as client:
        events = await _collect(client.send_message(message(data={"query": ""})))
        assert described(events[0]) == ("task", "TASK_STATE_REJECTED")
        rejected = events[0].task
        assert "query" in rejected.status.message.parts[0].text
        read = await client.get_task(GetTaskRequest(id=rejected.id))
        assert (read.id, read.status.state) == (rejected.id, TaskState.TASK_STATE_REJECTED)
        assert read.status.message.parts[0].text == rejected.status.message.parts[0].text
        [subscribed] = await _collect(client.subscribe(SubscribeToTaskRequest(id=rejected.id)))
        assert described(subscribed) == ("task", "TASK_STATE_REJECTED")
        with pytest.raises(A2AError, match="never ran"):
            await client.cancel_task(CancelTaskRequest(id=rejected.id))
    async with a2a_client(base, "Failing") as other_agent:
        with pytest.raises(A2AError):  # a task of Researcher's is none of Failing's
            await other_agent.get_task(GetTaskRequest(id=rejected.id))
