"""A model agent's runner is SIGKILLed between steps; another process resumes the run.

Both runner processes play the same script and append each model call to one file and
each tool execution to another, so the test can see which process called what.
"""

import asyncio
import signal
from contextlib import aclosing

from tether.adapters.event_log import EventLog
from tether.agents.clients.scripted import read_calls
from tether.contract.messages import WorkItem, work_item_json
from tether.domain.events import ParentRef
from tether.domain.ids import work_message_id
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-9")
ANSWER = "HTTP/3 runs over QUIC, which runs over UDP (2 searches)."


async def dispatch(log: EventLog, run_id: str) -> None:
    run = RunEvents(run_id, PARENT)
    await log.append_batch([run.requested("Researcher", input={"input": "HTTP/3?"}),
                            run.started()], expected_last_seq=0)
    item = WorkItem(run_id=run_id, parent=PARENT, agent_type="Researcher")
    await log.jetstream.publish(log.subjects.work("Researcher"), work_item_json(item),
                                headers={"Nats-Msg-Id": work_message_id(run_id, 1)},
                                stream=log.subjects.work_stream)


async def test_a_runner_killed_between_steps_is_resumed_without_repeating_a_recorded_step(
        log, services, tmp_path):
    calls, tools = tmp_path / "model-calls.jsonl", tmp_path / "tool-calls.jsonl"
    env = {"TETHER_AGENTS": "examples.model_agents:Researcher", "TETHER_WORK_ACK_WAIT_MS": "1000",
           "TETHER_SCRIPTED_CALLS_FILE": str(calls), "TETHER_EXAMPLE_TOOL_LOG": str(tools)}
    runners = await asyncio.gather(services("child-runner", **env),
                                   services("child-runner", **env))
    by_pid = {runner.process.pid: runner for runner in runners}
    await dispatch(log, "r-think")

    victim = None
    async with asyncio.timeout(20), aclosing(log.follow(
            log.subjects.run_events(PARENT, "r-think"))) as events:
        async for stored in events:
            event = stored.event
            if event.type == "run.running" and victim is None:
                victim = by_pid[int(event.data.runner_id.split(":")[1])]
            elif event.type == "run.step_recorded" and event.data.index == 0:
                victim.signal(signal.SIGKILL)  # while it asks the model for the second step
            elif event.type == "run.completed":
                break
    assert await victim.wait() == -signal.SIGKILL
    [survivor] = [runner for runner in runners if runner is not victim]

    history = await log.read_run(PARENT, "r-think")
    state, types = history.state, [e.type for e in history.events]
    assert (state.status, state.summary) == ("completed", ANSWER)
    assert [e.data.attempt for e in history.events if e.type == "run.running"] == [1, 2]
    recorded = [e.data.index for e in history.events if e.type == "run.step_recorded"]
    assert recorded == [0, 1, 2], "each step recorded once"
    assert types.index("run.step_recorded") < [i for i, t in enumerate(types)
                                               if t == "run.running"][1], "killed after step 0"

    model_calls = read_calls(calls)
    assert next(c["turn"] for c in model_calls if c["pid"] == victim.process.pid) == 0
    assert [c["turn"] for c in model_calls if c["pid"] == survivor.process.pid] == [1, 2], \
        "the survivor never asked the model for the recorded step"
    assert [c["turn"] for c in model_calls].count(0) == 1
    assert [(t["tool"], t["pid"]) for t in read_calls(tools)] == [
        ("search:HTTP/3", victim.process.pid), ("search:QUIC", survivor.process.pid)]
    request_ids = [step["turn"]["request_id"] for step in state.steps.values()]
    assert len(set(request_ids)) == 3
    assert state.output_text == ("Searching for sources.\n\nChecking the transport underneath."
                                 f"\n\n{ANSWER}")
    assert [(m.sequence, m.name) for m in state.milestones] == [(0, "sources-gathered"),
                                                                 (1, "sources-gathered")]
    done = await survivor.logged("work_item.done")
    assert [(line["outcome"], line["attempt"]) for line in done] == [("completed", 2)]
