"""Steering across a runner killed mid-run (SIGKILL), with the services as processes: a
message the child took in before the kill is not handed to the next attempt again, and
one sent while no runner held the run is handed to the runner that takes it over."""

import asyncio
import signal
from contextlib import aclosing

from service_processes import support_path

from tether.client import connect
from tether.domain.events import ParentRef

PARENT = ParentRef(agent="Assistant", name="steering")


async def test_a_message_is_taken_in_once_across_a_runner_killed_mid_run(
        log, services, settings):
    env = {"TETHER_AGENTS": "steered_agents:Listener", "TETHER_WORK_ACK_WAIT_MS": "1500",
           "PYTHONPATH": support_path()}
    _, *runners = await asyncio.gather(services("parent", **env),
                                       services("child-runner", **env),
                                       services("child-runner", **env))
    by_pid = {str(runner.process.pid): runner for runner in runners}
    async with connect(settings=settings) as tether:
        me = tether.parent(PARENT.agent, PARENT.name)
        call = asyncio.create_task(me.run_agent_tool("Listener", {}, run_id="steered"))
        await me.send("steered", "focus on QUIC", message_id="m1")
        victim = None
        subject = log.subjects.run_events(PARENT, "steered")
        async with asyncio.timeout(30), aclosing(log.follow(subject)) as events:
            async for stored in events:
                event = stored.event
                if event.type == "run.running" and victim is None:
                    victim = by_pid[event.data.runner_id.split(":")[1]]
                elif event.type == "run.milestone":
                    victim.signal(signal.SIGKILL)  # m1 taken in and kept: the child waits
                    break
        assert await victim.wait() == -signal.SIGKILL
        await me.send("steered", "then gRPC", message_id="m2")  # no runner holds the run
        result = await asyncio.wait_for(call, 30)
    assert result.ok and result.summary == "focus on QUIC + then gRPC", result

    history = await log.read_run(PARENT, "steered")
    receipts = [(e.type.removeprefix("run.message_"), e.data.message_id, e.data.attempt)
                for e in history.events if e.type.startswith("run.message_")
                and e.type != "run.message_sent"]
    assert receipts == [("delivered", "m1", 1), ("consumed", "m1", 1),
                        ("delivered", "m2", 2), ("consumed", "m2", 2)]
    assert history.state.attempt == 2 and history.state.waiting_messages == ()
