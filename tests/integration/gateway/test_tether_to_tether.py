"""One Tether's gateway serving its Researcher, and the same agent used back as a remote
child through each protocol (`tether.remote`): the remote side is a Tether run of the
caller's parent, and an MCP call names its run so the gateway's run has the calling run's
id with a digest of its parent and its life (a call made again after a crash finds the
same run; another parent's run of the same id, or a later life of it, is another)."""

import asyncio
from collections.abc import AsyncIterator

import gateway_agents
import pytest
from eventually import eventually
from gateway_stack import AGENTS, DESKTOP, DESKTOP_PARENT, running_gateway
from pydantic import BaseModel

from tether.agent_registry import AgentRegistry
from tether.client import connect
from tether.domain.ids import remote_run_id
from tether.log import get_logger
from tether.remote.a2a_agent import a2a_agent
from tether.remote.mcp_tool import mcp_tool_agent
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent

DEADLINE_S = 30


class Query(BaseModel):
    query: str


# Their URLs are the gateway's, known once it listens.
RemoteResearcher = a2a_agent("RemoteResearcher", "http://127.0.0.1:1/a2a/Researcher",
                             token_variable="GATEWAY_TOKEN", input_model=Query)
ResearchTool = mcp_tool_agent("ResearchTool", "http://127.0.0.1:1/mcp", "Researcher",
                              token_variable="GATEWAY_TOKEN", input_model=Query)
ApproveTool = mcp_tool_agent("ApproveTool", "http://127.0.0.1:1/mcp", "Approver",
                             token_variable="GATEWAY_TOKEN")
RemoteApprover = a2a_agent("RemoteApprover", "http://127.0.0.1:1/a2a/Approver",
                           token_variable="GATEWAY_TOKEN")
AskTool = mcp_tool_agent("AskTool", "http://127.0.0.1:1/mcp", "Asker",
                         token_variable="GATEWAY_TOKEN")
REMOTE = (RemoteResearcher, ResearchTool, ApproveTool, RemoteApprover, AskTool)


@pytest.fixture
async def services(gateway_settings, log, pool, nc, monkeypatch):
    """The parent service and a child-runner of the gateway's agents and of the remote
    ones, in this process."""
    monkeypatch.setenv("GATEWAY_TOKEN", DESKTOP)
    registry = AgentRegistry([*AGENTS, *REMOTE])
    runner = await open_runner(nc, gateway_settings, registry, fetch_timeout_s=0.3,
                               cancel_grace_s=0.2, shutdown_grace_s=0.2)
    parent = await open_parent(gateway_settings, log, pool, registry,
                               get_logger(service="parent-test"))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(runner.run(stop)), asyncio.create_task(parent.run(stop))]
    gateway_agents.RELEASE = asyncio.Event()
    yield
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)


@pytest.fixture
async def tether(services, gateway_settings, monkeypatch) -> AsyncIterator:
    async with running_gateway(gateway_settings) as mcp_url:
        base = mcp_url.removesuffix("/mcp")
        monkeypatch.setattr(RemoteResearcher, "url", f"{base}/a2a/Researcher")
        monkeypatch.setattr(RemoteApprover, "url", f"{base}/a2a/Approver")
        monkeypatch.setattr(ResearchTool, "server", mcp_url)
        monkeypatch.setattr(ApproveTool, "server", mcp_url)
        monkeypatch.setattr(AskTool, "server", mcp_url)
        async with connect(settings=gateway_settings) as client:
            yield client


async def test_a_tether_agent_served_over_a2a_is_a_remote_child_of_another_run(tether):
    me = tether.parent("Assistant", "far")
    result = await asyncio.wait_for(
        me.run_agent_tool("RemoteResearcher", {"query": "HTTP/3"}, run_id="over-a2a"),
        DEADLINE_S)
    assert result.ok, result
    task_id = result.output["task_id"]
    served = (await tether.read_run(DESKTOP_PARENT, task_id)).state
    assert served.agent_type == "Researcher" and served.status == "completed"
    assert served.input == {"query": "HTTP/3"}
    assert result.summary == "HTTP/3: two sources agree"


async def served_id(tether, me, run_id: str) -> str:
    """The run id the gateway's run of an MCP call has: the calling run's, with a digest
    of its parent and its life."""
    state = (await tether.read_run(me.ref, run_id)).state
    return remote_run_id(me.ref.agent, me.ref.name, run_id, state.incarnation)


async def test_a_tether_agent_served_over_mcp_is_a_remote_child_named_by_the_calling_run(
        tether):
    me = tether.parent("Assistant", "far")
    result = await asyncio.wait_for(
        me.run_agent_tool("ResearchTool", {"query": "gRPC"}, run_id="over-mcp"), DEADLINE_S)
    assert result.ok, result
    assert result.summary == "gRPC: two sources agree"
    served_run_id = await served_id(tether, me, "over-mcp")
    assert served_run_id.startswith("over-mcp-"), served_run_id
    served = (await tether.read_run(DESKTOP_PARENT, served_run_id)).state
    assert served.agent_type == "Researcher" and served.status == "completed"
    assert result.output["summary"] == served.summary


@pytest.mark.parametrize("protocol", ["mcp", "a2a"])
async def test_a_remote_task_that_asks_pauses_the_run_and_the_answer_reaches_it(tether,
                                                                                 protocol):
    """Over MCP the remote run's form is the local run's pending item, by its key; over
    A2A its question is one item, answered with the gateway's answers as data."""
    me = tether.parent("Assistant", "far")
    run_id = f"asks-{protocol}"
    agent = {"mcp": "ApproveTool", "a2a": "RemoteApprover"}[protocol]
    call = asyncio.create_task(me.run_agent_tool(agent, {}, run_id=run_id))

    async def paused():
        state = (await tether.read_run(me.ref, run_id)).state
        return state is not None and state.paused is not None and state

    state = await eventually(paused, timeout=DEADLINE_S)
    [item] = state.paused.pending
    if protocol == "mcp":
        assert (item["tool_call_id"], item["reason"]) == ("publish", "approval")
        assert item["input"]["message"] == "Approve publish({})?"
        await me.continue_run(run_id, approvals=["publish"])
        served_run_id = await served_id(tether, me, run_id)  # the call names its run
    else:
        assert (item["tool_call_id"], item["reason"]) == ("a2a-question-0", "input")
        await me.continue_run(run_id,
                              tool_outputs={"a2a-question-0": {"approvals": ["publish"]}})
        served_run_id = item["input"]["task_id"]
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "published", result
    served = (await tether.read_run(DESKTOP_PARENT, served_run_id)).state
    assert served.agent_type == "Approver" and served.status == "completed"
    assert served.resumptions[-1].decisions["approvals"] == ["publish"]
    assert len((await tether.read_run(me.ref, run_id)).state.resumptions) == 1


async def test_a_remote_output_the_run_rejects_reaches_the_remote_run_as_a_rejection(
        tether):
    """Tether declines a remote form for a rejection; the gateway's run takes it as one,
    where it once took nothing and the remote task asked for ever."""
    me = tether.parent("Assistant", "far")
    call = asyncio.create_task(me.run_agent_tool("AskTool", {}, run_id="rejects"))

    async def paused():
        state = (await tether.read_run(me.ref, "rejects")).state
        return state is not None and state.paused is not None and state

    [item] = (await eventually(paused, timeout=DEADLINE_S)).paused.pending
    assert (item["tool_call_id"], item["reason"]) == ("search", "input")
    await me.continue_run("rejects", rejections=["search"])
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "the search was rejected", result


@pytest.mark.parametrize("agent_type", ["ResearchTool", "RemoteResearcher"])
async def test_runs_of_two_parents_with_the_same_run_id_are_two_remote_runs(tether,
                                                                            agent_type):
    """A run id names a run only under its parent: two parents that both choose one, each
    through the same caller, get each its own remote run and its own answer, not the
    first one's; and so does a run id cleared and asked for again."""
    far, near = tether.parent("Assistant", "far"), tether.parent("Assistant", "near")
    first = await asyncio.wait_for(
        far.run_agent_tool(agent_type, {"query": "HTTP/3"}, run_id="shared"), DEADLINE_S)
    second = await asyncio.wait_for(
        near.run_agent_tool(agent_type, {"query": "QUIC"}, run_id="shared"), DEADLINE_S)
    assert (first.summary, second.summary) == ("HTTP/3: two sources agree",
                                               "QUIC: two sources agree")
    await far.clear("completed")

    async def cleared():
        return (await tether.read_run(far.ref, "shared")).state is None

    await eventually(cleared, timeout=DEADLINE_S)
    again = await asyncio.wait_for(
        far.run_agent_tool(agent_type, {"query": "gRPC"}, run_id="shared"), DEADLINE_S)
    assert again.summary == "gRPC: two sources agree"
