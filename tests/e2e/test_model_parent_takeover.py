"""A model parent's runner is SIGKILLed as it takes a notification in; another replica
takes the conversation over, and the notification gets exactly one model turn.

The conversation is examples/model_parent.py's Planner with its scripted model; both
runner processes append each model call to one file, so the test sees which process
asked the model for which turn.
"""

import asyncio
import signal
from contextlib import aclosing

from tether.agents.clients.scripted import read_calls
from tether.client import connect
from tether.domain.events import ParentRef

AGENTS = "examples.agents:Researcher,examples.agents:Importer,examples.model_parent:Planner"


async def test_a_conversation_killed_mid_notification_is_taken_over_with_one_turn_for_it(
        log, services, settings, tmp_path):
    calls = tmp_path / "model-calls.jsonl"
    env = {"TETHER_AGENTS": AGENTS, "TETHER_WORK_ACK_WAIT_MS": "1000",
           "TETHER_SCRIPTED_CALLS_FILE": str(calls)}
    await services("parent", TETHER_AGENTS=AGENTS)
    runners = await asyncio.gather(services("child-runner", **env),
                                   services("child-runner", **env))
    by_pid = {runner.process.pid: runner for runner in runners}
    owner = ParentRef(agent="User", name="u1")

    async with connect(settings=settings) as tether:
        conversation = tether.conversation("Planner", "takeover", owner=owner)
        await conversation.start()
        await conversation.send("Compare HTTP/3 and gRPC; import the customers.",
                                message_id="ask")
        victim, notice = None, None
        async with asyncio.timeout(60), aclosing(log.follow(
                log.subjects.run_events(owner, "takeover"))) as events:
            async for stored in events:
                event = stored.event
                if event.type == "run.running":
                    holder = by_pid[int(event.data.runner_id.split(":")[1])]
                    if victim is not None and holder is not victim:
                        break  # the other replica took the conversation over
                    victim = holder
                elif event.type == "run.step_recorded" and notice is None:
                    taken = [i for i in event.data.step["inbox"] if i.startswith("detached-finish:")]
                    if taken:
                        notice = taken[0]
                        victim.signal(signal.SIGKILL)  # as it asks the model about it
        assert await victim.wait() == -signal.SIGKILL
        [survivor] = [runner for runner in runners if runner is not victim]

        async with asyncio.timeout(30):
            reply = await conversation.reply(notice)
        assert reply.content.startswith("The customer import is done (imported 20,000 rows")

        history = await log.read_run(owner, "takeover")
        steps = [history.state.steps[i] for i in sorted(history.state.steps)]
        assert [(e.data.attempt, int(e.data.runner_id.split(":")[1]))
                for e in history.events if e.type == "run.running"] == [
            (1, victim.process.pid), (2, survivor.process.pid)]
        took_in = [s["inbox"] for s in steps if s["inbox"]]
        assert took_in.count([notice]) == 1, "the notification was taken in once"
        notice_call = next(s["call"] for s in steps if s["inbox"] == [notice])
        turns = [s for s in steps if s["call"] == notice_call and s["kind"] == "model_turn"]
        assert [t["status"] for t in turns] == ["completed"], "one model turn answered it"
        model_calls = read_calls(calls)
        recorded_before = {s["turn"]["request_id"] for s in steps
                           if s["kind"] == "model_turn" and s["call"] != notice_call}
        assert len(recorded_before) == 2
        # The turns recorded before the kill were asked for once, by the victim.
        assert [(c["turn"], c["pid"]) for c in model_calls if c["turn"] < 2] == [
            (0, victim.process.pid), (1, victim.process.pid)]
        # The turn for the notice, not recorded when the kill came: asked at most once
        # by each process (the victim was killed while the answer streamed).
        notice_turns = [c["pid"] for c in model_calls if c["turn"] >= 2]
        assert 1 <= len(notice_turns) == len(set(notice_turns)) <= 2
        # One run per tool call, each once: the takeover started no second child turn.
        view = None
        async for view in conversation.parent.timeline(live=False):  # noqa: B007 - the last view is wanted
            pass
        assert sorted((run.run_id, run.status) for run in view.runs.values()) == [
            ("agent-tool:call_0_0", "completed"), ("agent-tool:call_0_1", "completed"),
            ("agent-tool:call_0_2", "completed")]
        await conversation.close()
