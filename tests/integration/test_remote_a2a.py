"""A remote A2A agent as a Tether child, against the official SDK's own server (its
`DefaultRequestHandler` and in-memory task store, `remote_a2a_server.py`, a process of its
own) over real HTTP, with the parent service and child-runners on real NATS: one run is
one remote task, followed again by the runner that takes the run over, paused for a human
when the remote asks, cancelled with the run, waited for while the remote is down."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from eventually import eventually
from remote_servers import TOKEN, RemoteServer
from runner_stack import Stack

from tether.agent_registry import AgentConfigurationError
from tether.client import connect
from tether.remote.a2a_agent import a2a_agent

DEADLINE_S = 30


@pytest.fixture
async def remote(request) -> AsyncIterator[RemoteServer]:
    """The SDK's server; parametrized indirectly with its options (`polled`)."""
    server = RemoteServer("remote_a2a_server.py", *getattr(request, "param", ()))
    try:
        yield server
    finally:
        await server.kill()


@pytest.fixture
def echo(remote, monkeypatch):
    monkeypatch.setenv("ECHO_TOKEN", TOKEN)
    return a2a_agent("Echo", remote.url, token_variable="ECHO_TOKEN", unreachable_for_s=20,
                     description="Says back what it is told")


@pytest.fixture
async def stack(settings, log, pool, echo) -> AsyncIterator[Stack]:
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether, [echo])
        await started.start_parent()
        try:
            yield started
        finally:
            await started.close()


async def test_a_run_is_one_remote_task_whose_artifacts_are_its_output(remote, stack):
    await remote.start()
    await stack.start_runner()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Echo", {"text": "echo hello world"}, run_id="hello"),
        DEADLINE_S)
    assert result.ok, result
    assert result.summary == "echo: hello world"
    [execution] = (await remote.stats())["executions"]
    assert result.output["task_id"] == execution["task_id"]
    assert result.output["message"] == "done"
    assert [(a["name"], a["parts"]) for a in result.output["artifacts"]] == [
        ("echo", [{"text": "echo: hello world"}]), ("count", [{"data": {"words": 2.0}}])]
    state = await stack.state("hello")
    assert state.steps[0] == {"kind": "a2a.task", "url": remote.url,
                              "task_id": execution["task_id"],
                              "context_id": result.output["context_id"]}
    [milestone] = state.milestones
    assert milestone.name == "remote-task"
    assert milestone.data == {"task_id": execution["task_id"], "url": remote.url}


async def test_a_remote_that_fails_the_task_fails_the_run_with_its_message(remote, stack):
    await remote.start()
    await stack.start_runner()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Echo", {"text": "fail"}, run_id="failing"), DEADLINE_S)
    assert not result.ok and result.status == "error"
    [execution] = (await remote.stats())["executions"]
    assert result.error == (f"RemoteAgentError: task {execution['task_id']} of the A2A agent "
                            f"at {remote.url} failed: no such thing")


async def test_a_remote_question_is_a_human_pause_whose_answer_goes_to_the_same_task(
        remote, stack):
    await remote.start()
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "ask"}, run_id="asking"))

    state = await stack.until_paused("asking")
    [execution] = (await remote.stats())["executions"]
    assert state.paused.reason == "waiting_for_human"
    assert state.paused.pending == [{
        "tool_call_id": "a2a-question-0", "tool_name": "Echo", "reason": "input",
        "input": {"question": "Which language?", "task_id": execution["task_id"]}}]
    await stack.parent.continue_run("asking", human_input="French")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "in French"
    executions = (await remote.stats())["executions"]
    assert [e["task_id"] for e in executions] == [execution["task_id"]] * 2
    assert executions[1]["text"] == "French"


@pytest.mark.parametrize("remote", [(), ("polled",)], indirect=True, ids=["streamed", "polled"])
async def test_an_answer_the_remote_has_not_taken_yet_is_not_asked_for_again(remote, stack):
    """The remote acknowledges the answer before it takes it, sending the task back still
    asking the question answered: the run waits for the remote, not for a human, also in
    the attempt of a runner that takes the run over."""
    await remote.start()
    first = await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "ask late"}, run_id="asking-late"))
    await stack.until_paused("asking-late")
    await stack.parent.continue_run("asking-late", human_input="French")

    async def read_asking_answered(times: int):
        async def seen():
            return (await remote.stats())["read_asking_answered"] >= times
        await eventually(seen, timeout=DEADLINE_S)

    async def answer_recorded():
        state = await stack.state("asking-late")
        return 1 in state.steps and state

    state = await eventually(answer_recorded, timeout=DEADLINE_S)
    assert state.steps[1]["kind"] == "a2a.answer" and state.steps[1]["question"]
    [execution, _] = (await remote.stats())["executions"]
    taking = f"answered; waiting for task {execution['task_id']} to take the answer"
    if "polled" in remote.options:  # a stream of the answer stays open until it is taken
        await read_asking_answered(2)
        state = await stack.state("asking-late")
        assert state.paused is None and state.status == "running"
        assert state.progress.message == taking

    await stack.hand_over(first, "asking-late", DEADLINE_S)
    await read_asking_answered((await remote.stats())["read_asking_answered"] + 2)
    state = await stack.state("asking-late")
    assert state.paused is None and len(state.resumptions) == 1
    assert state.progress.message == taking

    await remote.release()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "in French", result
    executions = (await remote.stats())["executions"]
    assert [e["text"] for e in executions] == ["ask late", "French"], "answered once"


async def test_cancelling_the_run_cancels_the_remote_task(remote, stack):
    await remote.start()
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "hold on"}, run_id="held"))

    async def named():
        state = await stack.state("held")
        return state is not None and 0 in state.steps and state.steps[0]["task_id"]

    task_id = await eventually(named, timeout=DEADLINE_S)
    await stack.parent.cancel("held")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok and result.status == "aborted"
    assert (await remote.stats())["cancels"] == [task_id]


async def test_a_runner_that_stops_leaves_the_task_to_the_next_which_follows_it(
        remote, stack):
    await remote.start()
    first = await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "hold on"}, run_id="handed-over"))

    async def named():
        state = await stack.state("handed-over")
        return state is not None and 0 in state.steps and state

    await eventually(named, timeout=DEADLINE_S)
    await stack.hand_over(first, "handed-over", DEADLINE_S)  # the remote task goes on
    await remote.release()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "echo: on"
    stats = await remote.stats()
    assert len(stats["executions"]) == 1, "the input was sent once: one remote task"
    assert stats["cancels"] == []


async def test_a_remote_that_is_down_is_waited_for_and_said_so(remote, stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "echo late"}, run_id="late"))

    async def waiting():
        state = await stack.state("late")
        return (state is not None and state.progress is not None
                and state.progress.phase == "waiting_for_remote" and state)

    state = await eventually(waiting, timeout=DEADLINE_S)
    assert state.progress.message.startswith(
        f"the A2A agent at {remote.url} does not answer (reading its agent card: ConnectError")
    assert state.progress.message.endswith("trying again for up to 20s")
    await remote.start()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "echo: late"


async def test_a_remote_that_lost_the_task_fails_the_run_saying_so(remote, stack):
    await remote.start()
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "hold on"}, run_id="lost"))

    async def named():
        state = await stack.state("lost")
        return state is not None and 0 in state.steps and state.steps[0]["task_id"]

    task_id = await eventually(named, timeout=DEADLINE_S)
    await remote.kill()  # its tasks were in memory
    await remote.start()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok
    assert result.error == (f"RemoteAgentError: the A2A agent at {remote.url} no longer "
                            f"knows task {task_id} (it may keep its tasks in memory and have "
                            "restarted)")
    assert (await remote.stats())["executions"] == [], "the input was not sent again"


async def test_a_wrong_token_fails_the_run_naming_the_variable(remote, stack, monkeypatch):
    await remote.start()
    monkeypatch.setenv("ECHO_TOKEN", "wrong")
    await stack.start_runner()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Echo", {"text": "echo x"}, run_id="refused"), DEADLINE_S)
    assert not result.ok
    assert result.error == (f"RemoteAgentError: the A2A agent at {remote.url} refused the "
                            "call (HTTP 401): check the token in ECHO_TOKEN")


def test_a_remote_agent_without_its_token_or_url_is_refused_at_start(monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    agent = a2a_agent("Lacking", "http://127.0.0.1:1", token_variable="NO_SUCH_TOKEN")
    with pytest.raises(AgentConfigurationError, match="NO_SUCH_TOKEN"):
        agent.check_configuration()
    with pytest.raises(AgentConfigurationError, match="url must be"):
        a2a_agent("Nowhere", "ftp://x").check_configuration()


async def test_a_cancel_the_remote_cannot_hear_still_ends_the_run_cancelled(remote, stack):
    await remote.start()
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Echo", {"text": "hold on"}, run_id="unheard"))

    async def named():
        state = await stack.state("unheard")
        return state is not None and 0 in state.steps

    await eventually(named, timeout=DEADLINE_S)
    await remote.kill()  # the cancel cannot reach it
    await stack.parent.cancel("unheard")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok and result.status == "aborted", result
