"""An agent of each framework (Pydantic AI, the OpenAI Agents SDK, LangGraph) as the child of
runs on child-runner processes: the runner is killed (SIGKILL) while the model's second
request is in flight, the other runner takes the run over and replays the recorded
request and tool call (LangGraph: the finished nodes): neither is made again."""

import asyncio
import signal

import pytest
from eventually import eventually
from service_processes import support_path

from tether.client import connect
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="frameworks")


class Calls:
    """The unix socket the agents say their calls on; `go()` lets waiting ones go on."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []
        self.waiting: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, what = (await reader.readline()).decode().rstrip("\n").split(" ", 1)
        self.said.append((pid, what))
        if what == "answer":
            self.waiting.append(writer)

    def go(self) -> None:
        for writer in self.waiting:
            writer.write(b"x")

    def calls(self) -> list[str]:
        return [what for _, what in self.said]


@pytest.mark.parametrize("agent_type", ["KilledResearcher", "KilledSdkResearcher",
                                        "KilledGraphResearcher"])
async def test_a_runner_killed_mid_run_leaves_the_recorded_calls_to_be_replayed(
        agent_type, log, services, settings, tmp_path):
    calls = Calls()
    socket = tmp_path / "calls.sock"
    server = await asyncio.start_unix_server(calls.handle, path=str(socket))
    env = {"TETHER_AGENTS": f"framework_agents:{agent_type}",
           "TETHER_WORK_ACK_WAIT_MS": "1500", "FRAMEWORK_SOCKET": str(socket),
           "PYTHONPATH": support_path()}
    try:
        _, *runners = await asyncio.gather(services("parent", **env),
                                           services("child-runner", **env),
                                           services("child-runner", **env))
        by_pid = {str(runner.process.pid): runner for runner in runners}
        async with connect(settings=settings) as tether:
            me = tether.parent(PARENT.agent, PARENT.name)
            call = asyncio.create_task(me.run_agent_tool(
                agent_type, {"prompt": "QUIC"}, run_id="killed"))
            await eventually(lambda: calls.calls() == ["look up", "tool", "answer"],
                             timeout=30)
            victim = by_pid[calls.said[-1][0]]
            victim.signal(signal.SIGKILL)
            assert await victim.wait() == -signal.SIGKILL
            await eventually(lambda: len(calls.said) == 4, timeout=30)  # the other asks
            calls.go()
            result = await asyncio.wait_for(call, 30)
    finally:
        server.close()
    assert result.ok and result.summary == "found: two sources on QUIC", result
    # The first request and the tool call were recorded: given back, not made again.
    assert calls.calls() == ["look up", "tool", "answer", "answer"]
    assert calls.said[3][0] != calls.said[0][0]
    assert (await log.read_run(PARENT, "killed")).state.attempt == 2
