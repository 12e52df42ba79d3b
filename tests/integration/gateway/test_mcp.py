"""The gateway's MCP side against the official SDK's client, over real HTTP, with the
parent service and a child-runner on real NATS: each tool call is a durable Tether run."""

import asyncio
import contextlib
from contextlib import aclosing
from typing import Any

import anyio
import gateway_agents
import httpx2
import mcp_types as types
import pytest
from eventually import eventually
from gateway_stack import AGENTS, DESKTOP, DESKTOP_PARENT, LIMITED, mcp_client, running_gateway
from mcp import Client
from mcp.shared.exceptions import MCPError

from tether.agent_registry import AgentRegistry
from tether.client.parent import ParentHandle
from tether.domain.events import ParentRef
from tether.gateway import mcp_tools
from tether.generate.gateway import generate as gateway_documents
from tether.log import get_logger
from tether.remote.mcp_tasks import (
    RUN_ID_META,
    CreatedTask,
    TaskIdParams,
    TasksCancel,
    TasksExtension,
    TasksGet,
    TaskState,
    TasksUpdate,
    TaskUpdateParams,
)
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent


async def _run_events(log, parent: ParentRef, run_id: str) -> list[str]:
    return [event.type for event in (await log.read_run(parent, run_id)).events]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_caller_sees_one_tool_per_agent_type_it_may_call(gateway, mode):
    async with mcp_client(gateway, DESKTOP, mode=mode) as client:
        listed = await client.list_tools()
        tools = {tool.name: tool for tool in listed.tools}
    # What `make schemas` checks in is what the gateway serves.
    assert listed.model_dump(by_alias=True, mode="json", exclude_none=True)["tools"] == \
        gateway_documents(AgentRegistry(AGENTS))["mcp-tools.json"]["tools"]
    assert sorted(tools) == ["Approver", "Asker", "Failing", "Held", "HeldResearcher",
                            "Researcher", "Streamer", "Waiter"]
    researcher = tools["Researcher"]
    assert researcher.description == "Looks a question up and says what it found"
    assert researcher.input_schema["properties"]["query"]["description"] == "what to look into"
    assert researcher.input_schema["required"] == ["query"]
    async with mcp_client(gateway, LIMITED, mode=mode) as client:
        assert [tool.name for tool in (await client.list_tools()).tools] == ["Researcher"]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_call_is_a_run_of_the_callers_parent_with_progress_and_the_summary(
        gateway, log, mode):
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, total, message))

    async with mcp_client(gateway, DESKTOP, mode=mode) as client:
        result = await client.call_tool("Researcher", {"query": "HTTP/3"},
                                        progress_callback=on_progress)
    assert not result.is_error
    assert result.content[0].text == "HTTP/3: two sources agree"
    structured = result.structured_content
    assert structured["summary"] == "HTTP/3: two sources agree"
    assert structured["agent_type"] == "Researcher"
    run_id = structured["run_id"]
    events = await _run_events(log, DESKTOP_PARENT, run_id)
    assert [e for e in events if e != "run.progress_persisted"] == [
        "run.requested", "run.running", "run.milestone", "run.completed"]
    values = [value for value, _, _ in progress]
    assert values == sorted(set(values)), "each notification is a step further"
    assert any(message and "sources-gathered" in message for _, _, message in progress)


async def test_a_call_sends_its_runs_progress_before_its_result_when_its_feed_lags(
        gateway, monkeypatch):
    # The fault: the gateway's feed of the run is held until the call has its result, as
    # a feed that lags the end the result came by.
    ended = asyncio.Event()
    run_agent_tool, timeline = ParentHandle.run_agent_tool, ParentHandle.timeline

    async def ending(self, *args, **kwargs):
        answer = await run_agent_tool(self, *args, **kwargs)
        ended.set()
        return answer

    async def lagging(self, **kwargs):
        async with aclosing(timeline(self, **kwargs)) as views:
            async for view in views:
                await ended.wait()
                yield view

    monkeypatch.setattr(ParentHandle, "run_agent_tool", ending)
    monkeypatch.setattr(ParentHandle, "timeline", lagging)
    result, messages = await _research(gateway, "late")
    assert ended.is_set() and not result.is_error
    assert any(message and "sources-gathered" in message for message in messages)


async def test_a_call_whose_feed_of_its_run_stalls_still_ends(gateway, monkeypatch):
    monkeypatch.setattr(mcp_tools, "PROGRESS_SENT_WAIT_S", 0.3)

    async def stalled(self, **kwargs):
        await asyncio.Event().wait()  # the fault: the feed never delivers
        yield

    monkeypatch.setattr(ParentHandle, "timeline", stalled)
    result, messages = await _research(gateway, "stalled")
    assert not result.is_error
    assert result.structured_content["summary"] == "stalled: two sources agree"
    assert messages == [], "nothing from the stalled feed"


async def _research(gateway: str, query: str) -> tuple[types.CallToolResult, list[str | None]]:
    """The desktop caller's call of Researcher, and the messages of its progress."""
    messages: list[str | None] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        messages.append(message)

    async with mcp_client(gateway, DESKTOP) as client:
        result = await client.call_tool("Researcher", {"query": query},
                                        progress_callback=on_progress)
    return result, messages


async def test_a_call_that_names_its_run_id_runs_once_however_often_it_is_sent(gateway, log):
    meta = {RUN_ID_META: "mcp-named-1"}
    async with mcp_client(gateway, DESKTOP) as client:
        first = await client.call_tool("Researcher", {"query": "once"}, meta=meta)
        again = await client.call_tool("Researcher", {"query": "once"}, meta=meta)
    assert first.structured_content == again.structured_content
    assert first.structured_content["run_id"] == "mcp-named-1"
    events = await _run_events(log, DESKTOP_PARENT, "mcp-named-1")
    assert events.count("run.running") == 1 and events.count("run.completed") == 1


async def test_the_same_run_id_from_two_callers_is_two_runs(gateway, log):
    meta = {RUN_ID_META: "mcp-shared"}
    async with mcp_client(gateway, DESKTOP) as desktop, mcp_client(gateway, LIMITED) as limited:
        mine = await desktop.call_tool("Researcher", {"query": "mine"}, meta=meta)
        theirs = await limited.call_tool("Researcher", {"query": "theirs"}, meta=meta)
    assert mine.content[0].text == "mine: two sources agree"
    assert theirs.content[0].text == "theirs: two sources agree"
    assert "run.completed" in await _run_events(
        log, ParentRef(agent="Assistant", name="limited"), "mcp-shared")


async def test_a_failed_child_is_a_tool_error_with_the_structured_failure(gateway):
    async with mcp_client(gateway, DESKTOP) as client:
        result = await client.call_tool("Failing", {})
    assert result.is_error
    failure = result.structured_content
    assert failure["ok"] is False and failure["status"] == "error"
    assert failure["retryable"] is False
    assert result.content[0].text == failure["error"]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_cancelling_a_call_cancels_its_run(gateway, log, mode):
    waiting = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        waiting.set()

    meta = {RUN_ID_META: f"mcp-cancel-{mode}"}
    async def call(client: Client) -> None:
        await client.call_tool("Waiter", {}, progress_callback=on_progress, meta=meta)

    async with (mcp_client(gateway, DESKTOP, mode=mode) as client,
                anyio.create_task_group() as group):
        group.start_soon(call, client)
        await waiting.wait()  # the child is at work
        group.cancel_scope.cancel()

    async def aborted() -> bool:
        events = await _run_events(log, DESKTOP_PARENT, meta[RUN_ID_META])
        return "run.cancel_requested" in events and events[-1] == "run.aborted"

    await eventually(aborted, timeout=15)


async def test_a_caller_is_refused_a_tool_it_was_not_granted_and_a_stranger_everything(
        gateway):
    async with mcp_client(gateway, LIMITED) as client:
        with pytest.raises(MCPError) as refused:
            await client.call_tool("Waiter", {})
    assert "no tool 'Waiter'" in refused.value.error.message
    async with httpx2.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer not-a-caller"}):
            answer = await http.post(gateway, headers=headers, json={
                "jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
            assert answer.status_code == 401
            assert answer.headers["www-authenticate"].startswith("Bearer")


async def test_an_input_the_agent_refuses_is_a_tool_error_naming_the_field(gateway):
    async with mcp_client(gateway, DESKTOP) as client:
        result = await client.call_tool("Researcher", {"query": ""})
    assert result.is_error
    assert "query" in result.content[0].text


# --- tasks (MCP 2026-07-28, the io.modelcontextprotocol/tasks extension) -------------

async def _task(client: Client, task_id: str) -> TaskState:
    return await client.session.send_request(TasksGet(params=TaskIdParams(task_id=task_id)),
                                             TaskState)


async def _task_when(client: Client, task_id: str, status: str) -> TaskState:
    async def reached() -> TaskState | None:
        task = await _task(client, task_id)
        return task if task.status == status else None

    return await eventually(reached, timeout=15)


async def test_a_task_call_answers_at_once_and_the_task_outlives_the_gateway(
        services, gateway_settings):
    async with (running_gateway(gateway_settings) as url,
                mcp_client(url, DESKTOP, extensions=[TasksExtension()]) as client):
        created = await client.session.call_tool("Held", {}, allow_claimed=True,
                                                 meta={RUN_ID_META: "mcp-task-1"})
        assert isinstance(created, CreatedTask)
        assert created.task_id == "mcp-task-1" and created.status == "working"
        await _task_when(client, "mcp-task-1", "working")
    gateway_agents.RELEASE.set()  # the run finishes while no gateway runs
    async with running_gateway(gateway_settings) as url:
        async with mcp_client(url, DESKTOP, extensions=[TasksExtension()]) as client:
            done = await _task_when(client, "mcp-task-1", "completed")
            assert done.result["structuredContent"]["summary"] == "released"
        async with mcp_client(url, LIMITED, extensions=[TasksExtension()]) as stranger:
            with pytest.raises(MCPError):  # another caller's run id names another run
                await _task(stranger, "mcp-task-1")


async def test_a_task_waiting_for_a_human_is_input_required_and_its_answer_resumes_it(
        gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Approver", {}, allow_claimed=True)
        waiting = await _task_when(client, created.task_id, "input_required")
        form = waiting.input_requests["publish"]
        assert form["method"] == "elicitation/create"
        assert form["params"]["message"] == "Approve publish({})?"
        with pytest.raises(MCPError) as refused:
            await client.session.send_request(TasksUpdate(params=TaskUpdateParams(
                task_id=created.task_id, input_responses={"deploy": {"action": "accept"}})),
                types.EmptyResult)
        assert "asked for no such input" in refused.value.error.message
        await client.session.send_request(TasksUpdate(params=TaskUpdateParams(
            task_id=created.task_id, input_responses={
                "publish": {"action": "accept", "content": {"approve": True}}})),
            types.EmptyResult)
        done = await _task_when(client, created.task_id, "completed")
    assert done.result["content"][0]["text"] == "published"


async def test_a_cancelled_task_is_cancelled(gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Waiter", {}, allow_claimed=True)
        await _task_when(client, created.task_id, "working")
        await client.session.send_request(
            TasksCancel(params=TaskIdParams(task_id=created.task_id)), types.EmptyResult)
        await _task_when(client, created.task_id, "cancelled")


async def test_a_gateway_stopping_ends_its_calls_at_once_and_leaves_their_runs_going(
        services, gateway_settings, log):
    at_work = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        if message == "held":  # the child's own report, not the run's "starting"
            at_work.set()

    meta = {RUN_ID_META: "mcp-outlives"}
    async with contextlib.AsyncExitStack() as client_side:
        gateway = running_gateway(gateway_settings)
        url = await gateway.__aenter__()
        client = await client_side.enter_async_context(mcp_client(url, DESKTOP))
        call = asyncio.create_task(client.call_tool("Held", {}, meta=meta,
                                                    progress_callback=on_progress))
        await at_work.wait()
        async with asyncio.timeout(2):  # at once, not after the server's drain timeout
            await gateway.__aexit__(None, None, None)  # stopped under the call
        with pytest.raises(MCPError) as ended:
            await call
    assert "call again with _meta {'io.tether/run_id': 'mcp-outlives'}" in \
        ended.value.error.message
    events = await _run_events(log, DESKTOP_PARENT, "mcp-outlives")
    assert "run.cancel_requested" not in events and events[-1] == "run.running"
    gateway_agents.RELEASE.set()
    async with running_gateway(gateway_settings) as url, mcp_client(url, DESKTOP) as client:
        again = await client.call_tool("Held", {}, meta=meta)
    assert again.structured_content["summary"] == "released"


async def test_a_call_no_parent_service_takes_says_so_and_ends_once_one_does(
        gateway_settings, log, pool):
    told = asyncio.Event()
    messages: list[str] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")
        told.set()

    async with running_gateway(gateway_settings) as url, mcp_client(url, DESKTOP) as client:
        call = asyncio.create_task(client.call_tool(
            "Researcher", {"query": "served late"}, progress_callback=on_progress))
        await told.wait()  # no parent service runs yet
        assert "parent" in messages[0], messages
        registry = AgentRegistry(AGENTS)
        parent = await open_parent(gateway_settings, log, pool, registry,
                                   get_logger(service="parent-test"))
        runner = await open_runner(log.nats, gateway_settings, registry,
                                   fetch_timeout_s=0.3, shutdown_grace_s=0.2)
        stop = asyncio.Event()
        serving = [asyncio.create_task(parent.run(stop)), asyncio.create_task(runner.run(stop))]
        try:
            result = await call
        finally:
            stop.set()
            await asyncio.gather(*serving)
    assert result.content[0].text == "served late: two sources agree"


class _Raw(types.Request[dict[str, Any], str]):
    """A request as the test writes it: params the SDK's own models would not send."""


async def _update(client: Client, task_id: str, responses: dict[str, Any]) -> None:
    await client.session.send_request(TasksUpdate(params=TaskUpdateParams(
        task_id=task_id, input_responses=responses)), types.EmptyResult)


@pytest.mark.parametrize(("responses", "named"), [
    ({}, "inputResponses: empty; task"),
    ({"publish": {"action": "accept"}}, "inputResponses.publish.content.approve"),
    ({"publish": {"action": "accept", "content": {"approve": "yes"}}},
     "inputResponses.publish.content.approve: an accepted approval says true or false"),
])
async def test_an_update_that_decides_nothing_is_refused_and_the_task_still_asks(
        gateway, responses, named):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Approver", {}, allow_claimed=True)
        await _task_when(client, created.task_id, "input_required")
        with pytest.raises(MCPError) as refused:
            await _update(client, created.task_id, responses)
        assert refused.value.error.code == types.INVALID_PARAMS
        assert named in refused.value.error.message
        # Had the refused update resumed the run, it would have ended "not published"
        # before this answer is taken: continues are applied in order.
        await _update(client, created.task_id,
                      {"publish": {"action": "accept", "content": {"approve": True}}})
        done = await _task_when(client, created.task_id, "completed")
    assert done.result["content"][0]["text"] == "published"


async def test_a_cancelled_form_is_refused_naming_it_and_the_task_still_asks(gateway, log):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Approver", {}, allow_claimed=True)
        await _task_when(client, created.task_id, "input_required")
        with pytest.raises(MCPError) as refused:
            await _update(client, created.task_id, {"publish": {"action": "cancel"}})
        assert refused.value.error.code == types.INVALID_PARAMS
        assert refused.value.error.message.startswith(
            "inputResponses.publish.action: cancel answers nothing; task ")
        assert "still waits for a human's approval of publish" in refused.value.error.message
        await _update(client, created.task_id,
                      {"publish": {"action": "accept", "content": {"approve": True}}})
        done = await _task_when(client, created.task_id, "completed")
    assert done.result["content"][0]["text"] == "published"
    events = await _run_events(log, DESKTOP_PARENT, created.task_id)
    assert events.count("run.running") == 2, "resumed once, by the approval"


async def test_a_declined_output_form_is_a_rejection_the_run_sees(gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Asker", {}, allow_claimed=True)
        waiting = await _task_when(client, created.task_id, "input_required")
        assert waiting.input_requests["search"]["params"]["message"] == \
            'The output of search({"q": "tether"})'
        await _update(client, created.task_id, {"search": {"action": "decline"}})
        done = await _task_when(client, created.task_id, "completed")
    assert done.result["content"][0]["text"] == "the search was rejected"


@pytest.mark.parametrize(("method", "params", "named"), [
    ("tasks/get", {}, "params.taskId: Field required"),
    ("tasks/update", {"taskId": "t", "inputResponses": ["x"]},
     "params.inputResponses: Input should be a valid dictionary"),
    ("tools/call", {"name": "Researcher", "arguments": ["x"]},
     "params.arguments: Input should be a valid dictionary"),
])
async def test_a_request_whose_params_do_not_parse_is_refused_naming_the_field(
        gateway, method, params, named):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        with pytest.raises(MCPError) as refused:
            await client.session.send_request(_Raw(method=method, params=params),
                                              types.EmptyResult)
    assert refused.value.error.code == types.INVALID_PARAMS
    said = refused.value.error.message
    assert said.startswith(f"{method}: ") and named in said, said


async def test_an_input_required_task_says_what_it_waits_for_in_words(gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Approver", {}, allow_claimed=True)
        waiting = await _task_when(client, created.task_id, "input_required")
    assert waiting.status_message == "waiting for a human's approval of publish"


async def test_cancelling_a_task_that_has_ended_says_it_has(gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Researcher", {"query": "done"},
                                                 allow_claimed=True)
        await _task_when(client, created.task_id, "completed")
        with pytest.raises(MCPError) as refused:
            await client.session.send_request(
                TasksCancel(params=TaskIdParams(task_id=created.task_id)), types.EmptyResult)
    assert refused.value.error.code == types.INVALID_PARAMS
    assert refused.value.error.message == f"task {created.task_id} is already completed"


async def test_a_task_that_has_ended_shows_its_outcome_not_its_last_progress(gateway):
    async with mcp_client(gateway, DESKTOP, extensions=[TasksExtension()]) as client:
        created = await client.session.call_tool("Held", {}, allow_claimed=True)

        async def held():
            task = await _task(client, created.task_id)
            return task.status_message == "held"

        await eventually(held)
        gateway_agents.RELEASE.set()
        done = await _task_when(client, created.task_id, "completed")
    assert done.status_message == "released"
