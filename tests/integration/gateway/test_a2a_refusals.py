"""What the gateway's A2A side refuses, over real HTTP (raw JSON-RPC where the SDK's client
would not send it): an answer that would resume a paused run with no decision, a message
part it would drop, a ListTasks page it cannot give. Each refusal is -32602 naming the
field, and the refused request changes nothing: the task still asks, and its right
answer still works."""

import hashlib
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import gateway_agents
import pytest
from a2a.types import (
    GetTaskRequest,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from eventually import eventually
from gateway_stack import DESKTOP_PARENT, LIMITED, a2a_client, a2a_rpc, running_gateway
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Value

from tether.domain import events as ev
from tether.testing import RunEvents

INVALID_PARAMS = -32602


@pytest.fixture
async def base(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as mcp_url:
        yield mcp_url.removesuffix("/mcp")


def user_message(*parts: dict, task_id: str = "", message_id: str | None = None) -> dict:
    message = {"role": "ROLE_USER", "messageId": message_id or uuid.uuid4().hex,
               "parts": list(parts)}
    if task_id:
        message["taskId"] = task_id
    return {"message": message}


async def _approver_waiting(base: str) -> str:
    answer = await a2a_rpc(base, "Approver", "SendMessage", user_message({"data": {}}))
    task = answer["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    return task["id"]


@pytest.mark.parametrize(("part", "named"), [
    ({"data": {"approvals": "publish"}}, "parts[0].data.approvals: must be a list"),
    ({"data": {"approvals": [1]}}, "parts[0].data.approvals[0]: must be a tool call id"),
    ({"data": {"approvals": ["deploy"]}}, "waits on no tool call 'deploy'"),
    ({"data": ["publish"]}, "parts[0].data: must be an object"),
    ({"data": {"tool_outputs": ["x"]}}, "tool_outputs: must be an object"),
    ({"data": {}}, "answers nothing: it is waiting for a human's approval of publish"),
    ({"text": ""}, "answers nothing"),
    ({"url": "https://example.com/approval.txt"}, "parts[0]: a URL part is no answer"),
    ({"raw": "eA=="}, "parts[0]: a raw bytes part is no answer"),
])
async def test_an_answer_that_decides_nothing_is_refused_and_the_task_still_asks(
        base, part, named):
    task_id = await _approver_waiting(base)
    refused = await a2a_rpc(base, "Approver", "SendMessage",
                            user_message(part, task_id=task_id))
    assert refused["error"]["code"] == INVALID_PARAMS, refused
    assert named in refused["error"]["message"]
    # Had the refused answer resumed the run, it would have ended "not published"
    # before this answer is taken: continues are applied in order.
    answered = await a2a_rpc(base, "Approver", "SendMessage", user_message(
        {"data": {"approvals": ["publish"]}}, task_id=task_id))
    task = answered["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    assert task["artifacts"][-1]["parts"][0]["text"] == "published"


async def test_an_input_required_task_says_what_it_waits_for_in_words(base):
    task_id = await _approver_waiting(base)
    async with a2a_client(base, "Approver") as client:
        task = await client.get_task(GetTaskRequest(id=task_id))
    assert task.status.message.parts[0].text == "waiting for a human's approval of publish"


@pytest.mark.parametrize(("agent_type", "parts", "named"), [
    ("Held", [{"url": "https://example.com/input.json"}],
     ("parts[0]: a URL part is not taken; Held takes one data part with its input (see "
      "its card), or text (its 'text')")),
    ("Held", [{"raw": "eA==", "mediaType": "application/octet-stream"}],
     "parts[0]: a raw bytes part is not taken"),
    ("Researcher", [{"data": {"query": "x"}}, {"text": "and this too"}],
     "parts[1]: a text part beside the data part at parts[0]"),
])
async def test_a_message_with_a_part_the_agent_does_not_take_starts_nothing(
        base, log, agent_type, parts, named):
    message_id = uuid.uuid4().hex
    refused = await a2a_rpc(base, agent_type, "SendMessage",
                            user_message(*parts, message_id=message_id))
    assert refused["error"]["code"] == INVALID_PARAMS, refused
    assert named in refused["error"]["message"]
    run_id = "a2a-" + hashlib.sha256(f"desktop\0{message_id}".encode()).hexdigest()[:32]
    assert (await log.read_run(DESKTOP_PARENT, run_id)).state is None


@pytest.mark.parametrize(("params", "named"), [
    ({"pageSize": 0}, "pageSize: 0 is outside 1..100"),
    ({"pageSize": -1}, "pageSize: -1 is outside 1..100"),
    ({"pageSize": 101}, "pageSize: 101 is outside 1..100"),
    ({"pageToken": "bm90LWEtdGFzaw"}, "pageToken: 'bm90LWEtdGFzaw' is no page"),
    ({"pageToken": "%%%"}, "pageToken"),
    ({"pageToken": "MTIzOm5vIGlk"}, "pageToken: 'MTIzOm5vIGlk' is no page"),  # 123:no id
    ({"pageToken": "LTE6cjE"}, "pageToken: 'LTE6cjE' is no page"),  # -1:r1
])
async def test_a_list_page_that_cannot_be_given_is_refused(base, params, named):
    refused = await a2a_rpc(base, "Researcher", "ListTasks", params)
    assert refused["error"]["code"] == INVALID_PARAMS, refused
    assert named in refused["error"]["message"]


async def test_tasks_are_listed_a_page_at_a_time_with_their_total(base):
    started = []
    async with a2a_client(base, "Researcher", streaming=False) as client:
        for query in ("one", "two", "three"):
            [response] = [r async for r in client.send_message(_research(query))]
            started.append(response.task.id)
    async with a2a_client(base, "Failing", streaming=False) as client:
        [_ async for _ in client.send_message(_research("another agent type"))]
    async with a2a_client(base, "Researcher", streaming=False) as client:
        async def all_listed():  # once the projector has them
            listed = await client.list_tasks(ListTasksRequest(page_size=2))
            return listed if listed.total_size == 3 else None

        first = await eventually(all_listed)
        second = await client.list_tasks(ListTasksRequest(
            page_size=2, page_token=first.next_page_token))
        completed = await client.list_tasks(ListTasksRequest(
            status=TaskState.TASK_STATE_COMPLETED))
    assert [t.id for t in first.tasks] == started[:0:-1]  # newest first
    assert [t.id for t in second.tasks] == started[:1]
    assert (second.total_size, second.next_page_token) == (3, "")
    assert sorted(t.id for t in completed.tasks) == sorted(started)


def _research(query: str) -> SendMessageRequest:
    return SendMessageRequest(message=Message(
        role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
        parts=[Part(data=ParseDict({"query": query}, Value()))]))


async def _seed_runs(log, runs: list[tuple[str, str, int]]) -> None:
    """Runs (id, agent type, requested at) of the desktop caller's parent, straight into
    the log: tasks that were submitted long ago."""
    for run_id, agent_type, at in runs:
        event = RunEvents(run_id, DESKTOP_PARENT, start_ms=at).requested(agent_type)
        await log.append(event, expected_last_seq=None)


def _newest_first(runs: list[tuple[str, str, int]], agent_type: str) -> list[str]:
    return [run_id for run_id, of_type, _ in sorted(runs, key=lambda run: (-run[2], run[0]))
            if of_type == agent_type]


async def _listed(client, page_size: int, total: int, **request) -> ListTasksResponse:
    async def all_there():  # once the projector has them
        listed = await client.list_tasks(ListTasksRequest(page_size=page_size, **request))
        return listed if listed.total_size == total else None

    return await eventually(all_there, timeout=30)


async def test_a_caller_with_many_runs_pages_through_one_agent_types_tasks(base, log):
    """More runs than a page, of two agent types interleaved, two at a time requested at
    one instant: the pages hold this agent type's tasks newest first, each once, though a
    task started between two pages comes first; `totalSize` counts them all."""
    runs = [(f"seed-{i:04d}", "Failing" if i % 3 == 0 else "Researcher", 1_000_000 + i // 2)
            for i in range(520)]
    await _seed_runs(log, runs)
    researchers = _newest_first(runs, "Researcher")
    async with a2a_client(base, "Researcher", streaming=False) as client:
        first = await _listed(client, 100, len(researchers))
        [started] = [r async for r in client.send_message(_research("between pages"))]
        await _listed(client, 1, len(researchers) + 1)
        pages = [first]
        while pages[-1].next_page_token:
            pages.append(await client.list_tasks(ListTasksRequest(
                page_size=100, page_token=pages[-1].next_page_token)))
        newest = await client.list_tasks(ListTasksRequest(page_size=1))
    async with a2a_client(base, "Failing", streaming=False) as client:
        failing = await client.list_tasks(ListTasksRequest(page_size=5))
    assert [task.id for page in pages for task in page.tasks] == researchers
    assert [len(page.tasks) for page in pages] == [100, 100, 100, 46]
    assert [page.total_size for page in pages] == [346, 347, 347, 347]
    assert [task.id for task in newest.tasks] == [started.task.id]
    assert [task.id for task in failing.tasks] == _newest_first(runs, "Failing")[:5]
    assert failing.total_size == 174


async def test_tasks_of_a_state_that_shares_its_run_status_are_paged_and_counted(
        base, log):
    """An aborted run is a `canceled` task when it was cancelled, a `failed` one when not
    (as is a run that erred); a running run is `input-required` while it is paused, else
    `working`: filtered by the parent, such a state's pages are full and its total counts
    every task in it, none other."""
    for i in range(18):
        run = RunEvents(f"ended-{i:02d}", DESKTOP_PARENT, start_ms=2_000_000 + i // 6)
        ends = [[run.completed()], [run.failed()],
                [run.make(ev.RunCancelRequested), run.make(ev.RunAborted)],
                [run.make(ev.RunAborted, error="the child gave up", cause="child")],
                [], [run.make(ev.RunPaused, reason="waiting_for_tools")]][i % 6]
        for event in (run.requested("Researcher"), run.started(), run.running(), *ends):
            await log.append(event, expected_last_seq=None)
    async with a2a_client(base, "Researcher", streaming=False) as client:
        pages = {}
        for state, page_size, total in ((TaskState.TASK_STATE_FAILED, 4, 6),
                                        (TaskState.TASK_STATE_CANCELED, 2, 3),
                                        (TaskState.TASK_STATE_WORKING, 2, 3),
                                        (TaskState.TASK_STATE_INPUT_REQUIRED, 2, 3)):
            pages[state] = [await _listed(client, page_size, total, status=state)]
            pages[state].append(await client.list_tasks(ListTasksRequest(
                page_size=page_size, page_token=pages[state][0].next_page_token,
                status=state)))
        completed = await _listed(client, 4, 3, status=TaskState.TASK_STATE_COMPLETED)

    def ids(state) -> list[str]:
        return [task.id for page in pages[state] for task in page.tasks]

    failed, canceled = pages[TaskState.TASK_STATE_FAILED], pages[TaskState.TASK_STATE_CANCELED]
    assert ids(TaskState.TASK_STATE_FAILED) == ["ended-13", "ended-15", "ended-07",
                                                "ended-09", "ended-01", "ended-03"]
    assert [len(page.tasks) for page in failed] == [4, 2]
    assert (failed[1].total_size, failed[1].next_page_token) == (6, "")
    assert ids(TaskState.TASK_STATE_CANCELED) == ["ended-14", "ended-08", "ended-02"]
    assert (canceled[1].total_size, canceled[1].next_page_token) == (3, "")
    assert ids(TaskState.TASK_STATE_WORKING) == ["ended-16", "ended-10", "ended-04"]
    assert ids(TaskState.TASK_STATE_INPUT_REQUIRED) == ["ended-17", "ended-11", "ended-05"]
    assert {task.status.state for task in pages[TaskState.TASK_STATE_INPUT_REQUIRED][1].tasks
            } == {TaskState.TASK_STATE_INPUT_REQUIRED}
    assert [page.total_size for page in pages[TaskState.TASK_STATE_WORKING]] == [3, 3]
    assert [task.id for task in completed.tasks] == ["ended-12", "ended-06", "ended-00"]


async def test_a_message_in_a_context_not_the_callers_is_refused_naming_it(base, log):
    theirs = await a2a_rpc(base, "Researcher", "SendMessage",
                           user_message({"data": {"query": "theirs"}}), token=LIMITED)
    their_context = theirs["result"]["task"]["contextId"]
    assert their_context == "Assistant/limited"
    refusals = {}
    for context_id in (their_context, "no/such-context"):
        message_id = uuid.uuid4().hex
        params = user_message({"data": {"query": "mine"}}, message_id=message_id)
        params["message"]["contextId"] = context_id
        refused = await a2a_rpc(base, "Researcher", "SendMessage", params)
        assert refused["error"]["code"] == INVALID_PARAMS, refused
        refusals[context_id] = refused["error"]["message"].replace(context_id, "<id>")
        assert f"message.contextId: {context_id!r}" in refused["error"]["message"]
        run_id = "a2a-" + hashlib.sha256(f"desktop\0{message_id}".encode()).hexdigest()[:32]
        assert (await log.read_run(DESKTOP_PARENT, run_id)).state is None
    # Another caller's context is refused as one that does not exist: nothing of it shows.
    assert refusals[their_context] == refusals["no/such-context"]
    assert theirs["result"]["task"]["id"] not in refusals[their_context]
    params = user_message({"data": {"query": "mine"}})
    params["message"]["contextId"] = "Gateway/desktop"
    mine = await a2a_rpc(base, "Researcher", "SendMessage", params)
    assert mine["result"]["task"]["contextId"] == "Gateway/desktop"


@pytest.mark.parametrize(("params", "named"), [
    ([{"message": {}}], "params: must be an object (a SendMessageRequest), not a list"),
    ("message", "params: must be an object (a SendMessageRequest), not a string"),
    (None, "params: must be an object (a SendMessageRequest), not null"),
    ({"message": "hello"}, "params.message: must be an object, not a string"),
    ({"message": {"messageId": "m", "role": "ROLE_USER", "parts": "hello"}},
     "params.message.parts: must be a list, not a string"),
    ({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": 3}]}},
     "params.message.parts[0].text:"),
])
async def test_params_that_do_not_parse_are_refused_naming_the_field(base, params, named):
    refused = await a2a_rpc(base, "Researcher", "SendMessage", params)
    assert refused["error"]["code"] == INVALID_PARAMS, refused
    assert refused["error"]["message"].startswith(named), refused["error"]


async def test_a_tasks_status_message_keeps_its_id_however_often_it_is_read(base):
    async with a2a_client(base, "Held", streaming=False) as client:
        [started] = [r async for r in client.send_message(SendMessageRequest(
            message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                            parts=[Part(data=ParseDict({}, Value()))]),
            configuration=SendMessageConfiguration(return_immediately=True)))]
        task_id = started.task.id

        async def held():
            task = await client.get_task(GetTaskRequest(id=task_id))
            said = [part.text for part in task.status.message.parts]
            return task if said == ["held"] else None

        first = (await eventually(held)).status.message
        again = (await client.get_task(GetTaskRequest(id=task_id))).status.message
        assert (again.message_id, again.parts[0].text) == (first.message_id, "held")
        async with (a2a_client(base, "Held") as streaming,
                    aclosing(streaming.subscribe(SubscribeToTaskRequest(id=task_id))) as stream):
            subscribed = await anext(stream)
        assert subscribed.task.status.message.message_id == first.message_id
        gateway_agents.RELEASE.set()
        done = await eventually(lambda: _completed(client, task_id))
        read_again = await client.get_task(GetTaskRequest(id=task_id))
    assert done.status.message.parts[0].text == "released"
    assert done.status.message.message_id != first.message_id
    assert read_again.status.message.message_id == done.status.message.message_id


async def _completed(client, task_id: str):
    task = await client.get_task(GetTaskRequest(id=task_id))
    return task if task.status.state == TaskState.TASK_STATE_COMPLETED else None
