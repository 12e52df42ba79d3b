"""Remote agents (the official SDKs' servers, as processes) as the children of runs on
child-runner processes: the runner following an A2A agent's task is killed (SIGKILL), or
a runner is paused (SIGSTOP) before it sends an A2A task or calls an MCP tool; the other
runner takes the run over, and the run ends with one remote task, not two."""

import asyncio
import signal
from dataclasses import dataclass

import pytest
from eventually import eventually
from remote_servers import TOKEN, RemoteServer
from service_processes import support_path

from tether.client import connect
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="far")


def runner_env(remote: RemoteServer) -> dict[str, str]:
    return {"TETHER_AGENTS": "remote_children_agents:Echo,remote_children_agents:Counter",
            "TETHER_WORK_ACK_WAIT_MS": "1500", "REMOTE_A2A_URL": remote.url,
            "REMOTE_MCP_URL": f"{remote.url}/mcp", "ECHO_TOKEN": TOKEN,
            "PYTHONPATH": support_path()}


async def test_a_runner_killed_while_it_follows_a_remote_task_leaves_it_to_the_other(
        log, pool, services, settings):
    remote = RemoteServer("remote_a2a_server.py")
    await remote.start()
    try:
        env = runner_env(remote)
        _, *runners = await asyncio.gather(services("parent", **env),
                                           services("child-runner", **env),
                                           services("child-runner", **env))
        by_pid = {str(runner.process.pid): runner for runner in runners}
        async with connect(settings=settings) as tether:
            me = tether.parent(PARENT.agent, PARENT.name)
            call = asyncio.create_task(me.run_agent_tool("Echo", {"text": "hold on"},
                                                         run_id="far-away"))

            async def named():
                state = (await tether.read_run(PARENT, "far-away")).state
                return state is not None and 0 in state.steps and state

            state = await eventually(named, timeout=30)
            victim = by_pid[state.runner_id.split(":")[1]]
            victim.signal(signal.SIGKILL)
            assert await victim.wait() == -signal.SIGKILL

            async def taken_over():
                return (await tether.read_run(PARENT, "far-away")).state.attempt == 2

            await eventually(taken_over, timeout=30)
            await remote.release()
            result = await asyncio.wait_for(call, 30)
        assert result.ok and result.summary == "echo: on", result
        stats = await remote.stats()
        assert [e["task_id"] for e in stats["executions"]] == [state.steps[0]["task_id"]]
        assert stats["cancels"] == []
        history = await log.read_run(PARENT, "far-away")
        assert [e.type for e in history.events].count("run.step_recorded") == 1
    finally:
        await remote.kill()



@dataclass(frozen=True)
class Remote:
    script: str
    held: str  # the option that holds its answer to a runner's first request
    first_requests: str  # the statistic that counts such requests
    agent_type: str
    input: dict
    started: str  # the statistic that lists what it was asked to do


REMOTES = {"a2a": Remote("remote_a2a_server.py", "held-card", "card_reads", "Echo",
                         {"text": "echo twice"}, "executions"),
           "mcp": Remote("remote_mcp_server.py", "held-connect", "requests", "Counter",
                         {"words": "one two"}, "calls")}


@pytest.mark.parametrize("kind", REMOTES)
async def test_a_runner_paused_before_it_sends_the_task_sends_nothing_after_it_wakes(
        log, services, settings, kind):
    """SIGSTOP while the runner waits for the remote's first answer (the A2A agent's card,
    the MCP server's `initialize`), the task not sent yet: the other runner takes the run
    over and sends it. Woken, the paused runner gets that answer at once, and sends
    nothing: a second task of the remote would do the work twice, and nobody would follow
    or cancel it."""
    spec = REMOTES[kind]
    remote = RemoteServer(spec.script, spec.held)
    await remote.start()
    try:
        env = runner_env(remote)
        _, paused = await asyncio.gather(services("parent", **env),
                                         services("child-runner", **env))
        async with connect(settings=settings) as tether:
            me = tether.parent(PARENT.agent, PARENT.name)
            call = asyncio.create_task(me.run_agent_tool(spec.agent_type, spec.input,
                                                         run_id=f"paused-{kind}"))

            async def held():
                return (await remote.stats())[spec.first_requests] == 1

            await eventually(held, timeout=30)
            paused.signal(signal.SIGSTOP)
            try:
                await services("child-runner", **env)
                result = await asyncio.wait_for(call, 30)
                await remote.release()  # the answer goes out to the paused runner
            finally:
                paused.signal(signal.SIGCONT)
            [done] = await paused.logged("work_item.done", timeout=30)
        assert result.ok, result
        assert done["outcome"] == "superseded", done
        assert len((await remote.stats())[spec.started]) == 1
        history = await log.read_run(PARENT, f"paused-{kind}")
        assert [e.data.attempt for e in history.events if e.type == "run.running"] == [1, 2]
        assert [e.type for e in history.events].count("run.step_recorded") == 1
    finally:
        await remote.kill()
