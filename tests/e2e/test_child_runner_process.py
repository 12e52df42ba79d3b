"""Child-runner processes: one is killed mid-run, the other resumes the run."""

import asyncio
import json
import re
import signal
import time
from contextlib import aclosing

from eventually import eventually
from service_processes import SUPPORT, support_path

from tether.adapters.event_log import EventLog
from tether.contract.messages import WorkItem, work_item_json
from tether.domain.events import ParentRef
from tether.domain.ids import work_message_id
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-42")
AGENTS = "examples.agents:Sleeper,examples.agents:Summarizer"


async def dispatch(log: EventLog, agent_type: str, input: dict) -> RunEvents:
    run = RunEvents("r-resume", PARENT)
    await log.append_batch([run.requested(agent_type, input=input), run.started()],
                           expected_last_seq=0)
    item = WorkItem(run_id=run.run_id, parent=PARENT, agent_type=agent_type)
    await log.jetstream.publish(log.subjects.work(agent_type), work_item_json(item),
                                headers={"Nats-Msg-Id": work_message_id(run.run_id, 1)},
                                stream=log.subjects.work_stream)
    return run


async def test_a_runner_killed_mid_run_is_resumed_by_another_without_duplicates(
        log, services):
    runners = await asyncio.gather(
        services("child-runner", TETHER_AGENTS=AGENTS, TETHER_WORK_ACK_WAIT_MS="1500"),
        services("child-runner", TETHER_AGENTS=AGENTS, TETHER_WORK_ACK_WAIT_MS="1500"))
    by_pid = {str(runner.process.pid): runner for runner in runners}
    run = await dispatch(log, "Sleeper", {"seconds": 2, "milestones": 4})

    subject = log.subjects.run_events(PARENT, run.run_id)
    victim = None
    async with asyncio.timeout(20), aclosing(log.follow(subject)) as events:
        async for stored in events:
            event = stored.event
            if event.type == "run.running" and victim is None:
                victim = by_pid[event.data.runner_id.split(":")[1]]
            elif event.type == "run.milestone" and victim.process.returncode is None:
                victim.signal(signal.SIGKILL)
            elif event.type == "run.completed":
                break
    assert await victim.wait() == -signal.SIGKILL
    [survivor] = [runner for runner in runners if runner is not victim]

    history = await log.read_run(PARENT, run.run_id)
    running = [e.data for e in history.events if e.type == "run.running"]
    assert [r.attempt for r in running] == [1, 2]
    assert running[1].runner_id.split(":")[1] == str(survivor.process.pid)
    milestones = [(e.data.sequence, e.data.name) for e in history.events
                  if e.type == "run.milestone"]
    assert milestones == [(0, "step-1"), (1, "step-2"), (2, "step-3"), (3, "step-4")]
    assert [e.type for e in history.events].count("run.completed") == 1
    assert history.state.summary == "slept 2s"
    done = await survivor.logged("work_item.done")
    assert [(line["outcome"], line["attempt"]) for line in done] == [("completed", 2)]

    # Idle now: SIGTERM stops it cleanly.
    survivor.signal(signal.SIGTERM)
    assert await survivor.wait() == 0
    assert any(line.get("event") == "service.stopped" for line in survivor.lines)


async def test_a_runner_without_agents_stops_with_a_clear_error(services):
    runner = await services("child-runner")
    assert await runner.wait() == 2
    [error] = [line for line in runner.lines if line.get("event") == "child_runner.misconfigured"]
    assert "TETHER_AGENTS" in error["error"]




async def test_a_model_agent_without_a_model_client_is_refused_when_the_runner_starts(
        services):
    """Not when its first run starts: the runner exits 2 at once, naming the setting."""
    support = {"PYTHONPATH": support_path()}
    runner = await services("child-runner", TETHER_AGENTS="unscripted_agents:Unscripted",
                            **support)
    assert await runner.wait() == 2
    [error] = await runner.logged("child_runner.misconfigured")
    assert error["error"].startswith("Unscripted: no model client; set TETHER_MODEL_CLIENT=")
    assert not [line for line in runner.lines if line.get("event") == "child_runner.consuming"]

    wrong = await services("child-runner", TETHER_AGENTS="unscripted_agents:Unscripted",
                           TETHER_MODEL_CLIENT="no_such_module:client", **support)
    assert await wrong.wait() == 2
    [error] = await wrong.logged("child_runner.misconfigured")
    assert error["error"].startswith("TETHER_MODEL_CLIENT='no_such_module:client': ")


async def test_a_runner_paused_past_its_ack_wait_records_nothing_after_it_wakes(
        log, services, tmp_path):
    """SIGSTOP, not SIGKILL: the paused runner's item goes to the other runner, which
    takes the run over and completes it. Woken, the paused one starts no child turn,
    records nothing (no outcome, no hook), and its log says so, instead of taking the
    other attempt's stored outcome for its own."""
    turns = tmp_path / "turns.jsonl"
    env = {"TETHER_AGENTS": "stubborn_agents:Stubborn", "TETHER_WORK_ACK_WAIT_MS": "1500",
           "STUBBORN_TURNS": str(turns),
           "PYTHONPATH": support_path()}
    first = await services("child-runner", **env)
    run = await dispatch(log, "Stubborn", {"seconds": 3})
    subject = log.subjects.run_events(PARENT, run.run_id)

    def turns_started() -> list[dict]:
        return [json.loads(line) for line in turns.read_text().splitlines()
                ] if turns.exists() else []

    # Its child has started (a pause at a random moment can also fall before that: the
    # unit tests hold a runner that wakes before starting its child to the same rules).
    await eventually(lambda: len(turns_started()) == 1, timeout=20, interval=0.02)
    first.signal(signal.SIGSTOP)
    try:
        second = await services("child-runner", **env)
        async with asyncio.timeout(30), aclosing(log.follow(subject)) as events:
            async for stored in events:
                if stored.event.type == "run.completed":
                    break
    finally:
        woken_at = time.time()
        first.signal(signal.SIGCONT)

    [done] = await first.logged("work_item.done")
    assert done["outcome"] == "superseded", done
    # Its child returned at once on waking (its sleep ran out meanwhile), or the heartbeat
    # found out first and stopped it: in both cases nothing is recorded, and the line
    # says so.
    assert re.fullmatch(r"the child (finished|was stopped); attempt 2 took over the run: "
                        r"nothing recorded", done["detail"]), done
    started = turns_started()
    assert [turn["attempt"] for turn in started if turn["pid"] == first.process.pid] == [1]
    assert not [turn for turn in started if turn["at"] >= woken_at], started
    assert [turn["attempt"] for turn in started if turn["pid"] == second.process.pid] == [2]
    history = await log.read_run(PARENT, run.run_id)
    running = [e for e in history.events if e.type == "run.running"]
    assert [r.data.attempt for r in running] == [1, 2]
    assert running[1].data.runner_id.split(":")[1] == str(second.process.pid)
    [completed] = [e for e in history.events if e.type == "run.completed"]
    assert completed.causation_id == running[1].event_id
    assert not [line for line in first.lines
                if line.get("event") in ("delivery.hook_published", "work_item.error")]
    [finished] = await second.logged("work_item.done")
    assert (finished["outcome"], finished["attempt"]) == ("completed", 2)


async def test_a_child_blocking_the_event_loop_is_named_with_where_it_blocks(log, services):
    """`time.sleep` in a child stops every run and service of its process: the runner
    says which run's child did it and at which line, and for how long."""
    env = {"TETHER_AGENTS": "stubborn_agents:Blocker", "TETHER_LOOP_BLOCKED_WARN_MS": "300",
           "PYTHONPATH": support_path()}
    runner = await services("child-runner", **env)
    run = await dispatch(log, "Blocker", {"seconds": 1.5})

    [blocked] = await runner.logged("event_loop.blocked", timeout=20)
    [unblocked] = await runner.logged("event_loop.unblocked", timeout=20)
    [done] = await runner.logged("work_item.done", timeout=20)

    assert (blocked["run_id"], blocked["agent_type"]) == (run.run_id, "Blocker")
    line = next(number for number, text in enumerate(
        (SUPPORT / "stubborn_agents.py").read_text().splitlines(), start=1) if "BLOCKS:" in text)
    assert blocked["where"] == f"{SUPPORT / 'stubborn_agents.py'}:{line} in run", blocked
    assert "asyncio.to_thread" in blocked["hint"]
    assert 1_300 <= unblocked["blocked_ms"] < 3_000, unblocked
    assert done["outcome"] == "completed"


def versioned(version: str, **extra: str) -> dict[str, str]:
    """A runner of `versioned_agents:Versioned` whose code is version `version`."""
    return {"TETHER_AGENTS": "versioned_agents:Versioned", "AGENT_VERSION": version,
            "TETHER_WORK_ACK_WAIT_MS": "1500",
            "PYTHONPATH": support_path(),
            **extra}


async def test_runners_of_two_versions_of_one_agent_type_both_say_so(log, services):
    first = await services("child-runner", **versioned("v1"))
    await first.logged("child_runner.consuming")
    second = await services("child-runner", **versioned("v2"))

    [asked] = await second.logged("agent.versions_differ", timeout=15)
    [answered] = await first.logged("agent.versions_differ", timeout=15)

    assert asked["agent_type"] == answered["agent_type"] == "Versioned"
    [first_id] = [line["runner_id"] for line in await first.logged("child_runner.consuming")]
    [second_id] = [line["runner_id"] for line in await second.logged("child_runner.consuming")]
    assert asked["versions"] == {"v1": [first_id], "v2": ["this runner"]}
    assert answered["versions"] == {"v1": ["this runner"], "v2": [second_id]}
    third = await services("child-runner", **versioned("v1"))
    [listed] = await third.logged("agent.versions_differ", timeout=15)
    assert listed["versions"] == {"v1": sorted([first_id, "this runner"]), "v2": [second_id]}


async def resumed_by_another_version(log, services, policy: str):
    """A run begun by a runner of version v1, killed mid-run; a runner of v2 takes the
    item over. Its history once it has ended, and the v2 runner."""
    first = await services("child-runner", **versioned("v1"))
    run = await dispatch(log, "Versioned", {"seconds": 30})
    subject = log.subjects.run_events(PARENT, run.run_id)
    async with asyncio.timeout(20), aclosing(log.follow(subject)) as events:
        async for stored in events:
            if stored.event.type == "run.milestone":
                break
    first.signal(signal.SIGKILL)
    await first.wait()
    second = await services("child-runner",
                            **versioned("v2", TETHER_RESUME_OTHER_VERSIONS=policy))
    await second.logged("work_item.done", timeout=40)
    return await log.read_run(PARENT, run.run_id), second


async def test_a_run_resumed_by_another_version_is_warned_of_and_records_it(log, services):
    history, second = await resumed_by_another_version(log, services, "resume")

    running = [e.data for e in history.events if e.type == "run.running"]
    assert [(r.attempt, r.agent_version) for r in running] == [(1, "v1"), (2, "v2")]
    assert history.state.agent_version == "v2"
    [changed] = await second.logged("run.version_changed")
    assert (changed["recorded"], changed["running"], changed["attempt"]) == ("v1", "v2", 2)


async def test_a_runner_told_to_refuse_other_versions_fails_the_run_naming_both(log, services):
    history, _ = await resumed_by_another_version(log, services, "refuse")

    assert history.state.status == "error"
    assert history.state.error == (
        "run r-resume began under version v1 of Versioned; this runner runs version v2, "
        "and TETHER_RESUME_OTHER_VERSIONS=refuse: it is not resumed by other code")
    assert [e.data.agent_version for e in history.events if e.type == "run.running"] == ["v1"]
