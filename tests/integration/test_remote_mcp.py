"""One tool of a remote MCP server as a Tether child, against a server made with the
official SDK (`remote_mcp_server.py`, a process of its own, with and without the tasks
extension) over real HTTP, with the parent service and child-runners on real NATS: a call
answered with a task is followed by its recorded id (again by the runner that takes the
run over), a plain call by its progress; a cancel reaches the server; a server that is
down is waited for."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from eventually import eventually
from remote_servers import TOKEN, RemoteServer
from runner_stack import Stack

from tether import agent_tool
from tether.agents import AgentDefinition, ModelAgent, Reply, ScriptedModelClient
from tether.client import connect
from tether.remote.mcp_tool import mcp_tool_agent

DEADLINE_S = 30


@pytest.fixture(params=["tasks", "plain"])
async def remote(request) -> AsyncIterator[RemoteServer]:
    server = RemoteServer("remote_mcp_server.py", *(["plain"] if request.param == "plain" else []))
    server.tasks = request.param == "tasks"
    try:
        yield server
    finally:
        await server.kill()


@pytest.fixture
def agents(remote, monkeypatch) -> dict[str, type]:
    """A child per tool of the server, and a model parent with the counting one as its
    agent tool."""
    monkeypatch.setenv("TOOLS_TOKEN", TOKEN)
    tools = {name: mcp_tool_agent(name, f"{remote.url}/mcp", tool, token_variable="TOOLS_TOKEN",
                                  unreachable_for_s=20)
             for name, tool in (("Count", "count"), ("Hold", "hold"), ("Boom", "boom"),
                                ("Publish", "publish"))}

    class Desk(ModelAgent):
        definition = AgentDefinition(
            id="desk", model="scripted", max_steps=3, instructions="Count with the tool.",
            tools=(agent_tool(tools["Count"], description="Counts words, remotely."),))
        script = ()

    return {**tools, "Desk": Desk}


@pytest.fixture
async def stack(settings, log, pool, agents) -> AsyncIterator[Stack]:
    async with connect(settings=settings) as tether:
        started = Stack(settings, log, pool, tether, list(agents.values()))
        await started.start_parent()
        try:
            yield started
        finally:
            await started.close()


async def test_a_call_is_a_run_whose_output_is_the_structured_result(remote, stack):
    await remote.start()
    await stack.start_runner()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Count", {"words": "one two three"}, run_id="counted"),
        DEADLINE_S)
    assert result.ok, result
    assert result.output == {"words": 3}
    assert (await remote.stats())["calls"] == [{"tool": "count", "words": "one two three"}]
    state = await stack.state("counted")
    if remote.tasks:
        assert state.steps[0]["kind"] == "mcp.task"
        assert state.steps[0]["tool"] == "count"
        assert [m.name for m in state.milestones] == ["remote-task"]
    else:
        assert state.steps == {} and state.milestones == ()


async def test_a_tool_error_fails_the_run_with_its_text(remote, stack):
    await remote.start()
    await stack.start_runner()
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Boom", {}, run_id="boom"), DEADLINE_S)
    assert not result.ok
    assert result.error == (f"RemoteAgentError: the tool boom of the MCP server at "
                            f"{remote.url}/mcp failed: Error executing tool boom: boom failed")


async def test_cancelling_the_run_cancels_the_call(remote, stack):
    await remote.start()
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Hold", {"words": "a b"}, run_id="held"))

    async def called():
        return (await remote.stats())["calls"] != []

    await eventually(called, timeout=DEADLINE_S)
    if remote.tasks:
        async def named():
            return 0 in (await stack.state("held")).steps
        await eventually(named, timeout=DEADLINE_S)
    await stack.parent.cancel("held")
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert not result.ok and result.status == "aborted"

    async def cancelled():
        return (await remote.stats())["cancels"] != []

    await eventually(cancelled, timeout=DEADLINE_S)
    if remote.tasks:
        state = await stack.state("held")
        assert (await remote.stats())["cancels"][0] == state.steps[0]["task_id"]


async def test_a_runner_that_stops_leaves_a_task_to_the_next_and_a_plain_call_is_made_again(
        remote, stack):
    await remote.start()
    first = await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Hold", {"words": "x y"}, run_id="handed-over"))

    async def under_way():
        state = await stack.state("handed-over")
        return (await remote.stats())["calls"] != [] and (not remote.tasks or 0 in state.steps)

    await eventually(under_way, timeout=DEADLINE_S)
    await stack.hand_over(first, "handed-over", DEADLINE_S)
    if not remote.tasks:
        async def called_again():
            return len((await remote.stats())["calls"]) == 2
        await eventually(called_again, timeout=DEADLINE_S)
    await remote.release()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == {"words": 2}
    stats = await remote.stats()
    if remote.tasks:  # the next attempt followed the task
        assert len(stats["calls"]) == 1 and stats["cancels"] == []
    else:  # the stopped attempt's call was cancelled with it, and the tool called again
        assert len(stats["calls"]) == 2 and stats["cancels"] == ["call"]


@pytest.mark.parametrize("remote", ["tasks"], indirect=True)
async def test_an_answer_the_server_has_not_taken_yet_is_not_asked_for_again(remote, stack):
    """The server acknowledges the human's answer before it takes it, and meanwhile its
    task still asks with the same form (the extension allows both): the run waits for the
    server, not for a human, also in the attempt of a runner that takes the run over."""
    await remote.start()
    first = await stack.start_runner()
    call = asyncio.create_task(stack.parent.run_agent_tool("Publish", {}, run_id="publishing"))

    state = await stack.until_paused("publishing")
    assert [(item["tool_call_id"], item["reason"]) for item in state.paused.pending] == [
        ("approve-1", "approval")]
    await stack.parent.continue_run("publishing", approvals=["approve-1"])

    async def asked_again(times: int):
        async def seen():
            return (await remote.stats())["asked_after_answer"] >= times
        await eventually(seen, timeout=DEADLINE_S)

    await asked_again(2)
    state = await stack.state("publishing")
    assert state.paused is None and state.status == "running"
    assert state.steps[1] == {"kind": "mcp.answer", "pause": 0, "keys": ["approve-1"]}

    await stack.hand_over(first, "publishing", DEADLINE_S)
    await asked_again((await remote.stats())["asked_after_answer"] + 2)
    state = await stack.state("publishing")
    assert state.paused is None and len(state.resumptions) == 1

    await remote.apply()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "published", result
    stats = await remote.stats()
    assert stats["updates"] == [{"approve-1": {"action": "accept",
                                               "content": {"approve": True}}}]
    assert len(stats["calls"]) == 1


async def test_a_server_that_is_down_is_waited_for_and_said_so(remote, stack):
    await stack.start_runner()
    call = asyncio.create_task(
        stack.parent.run_agent_tool("Count", {"words": "late"}, run_id="late"))

    async def waiting():
        state = await stack.state("late")
        return (state is not None and state.progress is not None
                and state.progress.phase == "waiting_for_remote" and state)

    state = await eventually(waiting, timeout=DEADLINE_S)
    assert state.progress.message.startswith(
        f"the MCP server at {remote.url}/mcp does not answer (calling count: ConnectError")
    await remote.start()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.output == {"words": 1}


async def test_a_model_parent_delegates_to_the_remote_tool_through_agent_tool(
        remote, stack, agents, monkeypatch):
    await remote.start()
    await stack.start_runner()
    model = ScriptedModelClient([Reply("Counting.", [("Count", {"words": "to be or not"})]),
                                 Reply("Four words.")])
    monkeypatch.setattr(agents["Desk"], "model_client", model)
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Desk", {"input": "How many words?"}, run_id="desk"),
        DEADLINE_S)
    assert result.ok and result.summary == "Four words."
    [shown] = [m.content for m in model.requests[1].messages if m.role == "tool"]
    assert '"words": 4' in shown  # the remote tool's result, as the model saw it
    assert (await remote.stats())["calls"] == [{"tool": "count", "words": "to be or not"}]
