"""A remote A2A agent (the official SDK's server, a process) as the child of runs on
child-runner processes: the runner following the remote task is killed (SIGKILL), the
other one takes the run over, follows the same task, and the run ends with one remote
task, not two."""

import asyncio
import signal

from eventually import eventually
from remote_servers import TOKEN, RemoteServer
from service_processes import support_path

from tether.client import connect
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="far")


async def test_a_runner_killed_while_it_follows_a_remote_task_leaves_it_to_the_other(
        log, pool, services, settings):
    remote = RemoteServer("remote_a2a_server.py")
    await remote.start()
    try:
        env = {"TETHER_AGENTS": "remote_children_agents:Echo", "TETHER_WORK_ACK_WAIT_MS": "1500",
               "REMOTE_A2A_URL": remote.url, "ECHO_TOKEN": TOKEN,
               "PYTHONPATH": support_path()}
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
