"""Runs through the whole system: the client, the parent, child-runners and the projector
as real processes, over the wire contract only."""

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest
from eventually import eventually
from service_processes import ready

from tether.adapters.event_log import EventLog
from tether.client import Tether, TimelineView, connect
from tether.contract.messages import AgentToolFailure, AgentToolSuccess, DetachedHandle, RunInfo
from tether.domain.events import ParentRef
from tether.domain.fold import evolve

AGENTS = ("examples.agents:Researcher,examples.agents:Summarizer,"
          "examples.agents:Failing,examples.agents:Sleeper,examples.nested:Coordinator")
ASSISTANT = ("Assistant", "user-42")
RESEARCH_SUMMARY = "HTTP/3: the two sources agree on the essentials."


@pytest.fixture
async def stack(log, pool, services) -> None:
    """Parent, two child-runners and the projector; `log` and `pool` clean up after."""
    # Enough runner slots for all four agent types' fetch loops (batches of 10) at once.
    runner_env = {"TETHER_AGENTS": AGENTS, "TETHER_RUNNER_CONCURRENCY": "64"}
    started = await asyncio.gather(
        services("parent", TETHER_AGENTS=AGENTS), services("projector"),
        services("child-runner", **runner_env), services("child-runner", **runner_env))
    await asyncio.gather(*(ready(service) for service in started))


@pytest.fixture
async def tether(stack, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


async def events_of(log: EventLog, run_id: str, parent=ASSISTANT) -> list[str]:
    return [e.type for e in (await log.read_run(ParentRef(agent=parent[0], name=parent[1]),
                                                run_id)).events]


async def wait_for_event(log: EventLog, run_id: str, event_type: str, timeout: float = 30,
                         after_seq: int = 0) -> None:
    """Until the run's subject holds an event of the type after stream sequence `after_seq`."""
    subject = log.subjects.run_events(ParentRef(agent=ASSISTANT[0], name=ASSISTANT[1]), run_id)
    async with (asyncio.timeout(timeout),
                aclosing(log.follow(subject, start_seq=after_seq + 1)) as events):
        async for stored in events:
            if stored.event is not None and stored.event.type == event_type:
                return


async def test_an_awaited_run_returns_the_summary_and_a_repeat_returns_it_again(tether, log):
    me = tether.parent(*ASSISTANT)
    result = await me.run_agent_tool("Researcher", {"query": "HTTP/3"}, run_id="research-1")
    assert isinstance(result, AgentToolSuccess)
    assert result.summary == RESEARCH_SUMMARY

    again = await me.run_agent_tool("Researcher", {"query": "HTTP/3"}, run_id="research-1")
    assert again == result
    types = await events_of(log, "research-1")
    assert types.count("run.requested") == 1 and types.count("run.running") == 1
    snapshot = await me.inspect("research-1")
    assert snapshot.status == "completed"
    assert [m.name for m in snapshot.milestones] == ["sources-gathered"]


async def test_a_detached_run_returns_at_once_and_its_finish_hook_fires_once(tether, log):
    calls: list[tuple[RunInfo, str]] = []
    fired = asyncio.Event()
    hooks = tether.hooks(ASSISTANT[0])

    @hooks.on_finish("on_nap_done")
    async def on_nap_done(run, result):
        calls.append((run, result.status))
        fired.set()

    me = tether.parent(*ASSISTANT)
    async with hooks.running():
        started = time.monotonic()
        handle = await me.run_agent_tool("Sleeper", {"seconds": 1.5}, run_id="nap-1",
                                         detached={"on_finish": "on_nap_done"})
        returned_after = time.monotonic() - started
        assert handle == DetachedHandle(run_id="nap-1", agent_type="Sleeper", status="running")
        assert returned_after < 1.0, "the handle does not wait for the child"
        await asyncio.wait_for(fired.wait(), timeout=30)
        await wait_for_event(log, "nap-1", "run.finish_delivered")
    assert [(run.run_id, status) for run, status in calls] == [("nap-1", "completed")]
    assert (await events_of(log, "nap-1")).count("run.finish_delivered") == 1


async def test_a_detached_run_naming_an_unregistered_hook_is_rejected(tether):
    handle = await tether.parent(*ASSISTANT).run_agent_tool(
        "Summarizer", {"text": "x"}, detached={"on_finish": "nobody_listens"})
    assert handle.status == "error" and "nobody_listens" in handle.error


async def test_a_fan_out_of_three_runs_concurrently_on_one_connection(tether):
    me = tether.parent(*ASSISTANT)
    texts = ["alpha", "beta", "gamma"]
    results = await asyncio.gather(*(
        me.run_agent_tool("Summarizer", {"text": text}, parent_tool_call_id="call-fan",
                          display_order=order)
        for order, text in enumerate(texts)))
    assert [result.summary for result in results] == ["ALPHA", "BETA", "GAMMA"]
    view = None
    async for view in me.timeline(live=False):  # noqa: B007 - the last view is wanted
        pass
    assert [run.summary for run in view.runs_for_tool_call("call-fan")] == ["ALPHA", "BETA", "GAMMA"]


async def test_an_unknown_agent_type_is_a_failure_and_leaves_no_run(tether):
    me = tether.parent(*ASSISTANT)
    result = await me.run_agent_tool("Nope", {"x": 1}, run_id="nope-1")
    assert isinstance(result, AgentToolFailure)
    assert (result.status, result.retryable) == ("error", False)
    assert "Nope" in result.error
    assert await me.has_run("nope-1") is False
    assert await me.inspect("nope-1") is None


async def test_a_child_that_raises_is_an_error_failure(tether):
    result = await tether.parent(*ASSISTANT).run_agent_tool("Failing", {"message": "kaputt"})
    assert (result.ok, result.status, result.retryable) == (False, "error", False)
    assert "kaputt" in result.error


async def test_cancel_ends_an_awaited_run_aborted(tether, log):
    me = tether.parent(*ASSISTANT)
    awaiting = asyncio.create_task(me.run_agent_tool("Sleeper", {"seconds": 60}, run_id="long-1"))
    await wait_for_event(log, "long-1", "run.running")
    await me.cancel("long-1")
    result = await asyncio.wait_for(awaiting, timeout=30)
    assert (result.ok, result.status, result.retryable) == (False, "aborted", False)

    # Cancelling the awaiting task cancels the run too.
    abandoned = asyncio.create_task(me.run_agent_tool("Sleeper", {"seconds": 60}, run_id="long-2"))
    await wait_for_event(log, "long-2", "run.running")
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await wait_for_event(log, "long-2", "run.aborted")
    assert (await me.inspect("long-2")).status == "aborted"


async def test_inspect_from_another_parent_gets_none(tether):
    owner, stranger = tether.parent(*ASSISTANT), tether.parent("Assistant", "user-7")
    await owner.run_agent_tool("Summarizer", {"text": "mine"}, run_id="private-1")
    assert (await owner.inspect("private-1")).summary == "MINE"
    assert await stranger.inspect("private-1") is None
    assert await stranger.has_run("private-1") is False


async def test_list_runs_comes_from_the_projections(tether):
    me = tether.parent(*ASSISTANT)
    await me.run_agent_tool("Summarizer", {"text": "listed"}, run_id="listed-1")
    # The projector catches up asynchronously.
    runs = await eventually(lambda: me.list_runs(status=["completed"]), timeout=30,
                            interval=0.1)
    assert [run.run_id for run in runs] == ["listed-1"]


async def test_a_late_timeline_subscriber_sees_what_an_early_one_saw(tether):
    me = tether.parent(*ASSISTANT)
    views: list[TimelineView] = []
    changed = asyncio.Condition()

    async def watch() -> None:
        async for view in me.timeline():
            async with changed:
                views.append(view)
                changed.notify_all()

    early = asyncio.create_task(watch())
    try:
        async with changed:
            await changed.wait_for(lambda: bool(views) and views[-1].caught_up)
        await me.run_agent_tool("Researcher", {"query": "HTTP/3"}, parent_tool_call_id="call-t")
        # The early subscriber shows the research finished before the next run is asked for:
        # it follows the runs live, rather than catching up when the late one reads.
        async with asyncio.timeout(10), changed:
            await changed.wait_for(lambda: any(
                run.status == "completed" for run in views[-1].runs_for_tool_call("call-t")))
        following = len(views)
        await me.run_agent_tool("Summarizer", {"text": "side"})
        late = None
        async for late in me.timeline(live=False):  # noqa: B007 - the last view is wanted
            pass
        async with asyncio.timeout(10), changed:
            await changed.wait_for(lambda: views[-1] == late)
    finally:
        early.cancel()
        await asyncio.gather(early, return_exceptions=True)
    [research] = late.runs_for_tool_call("call-t")
    assert research.status == "completed" and research.summary == RESEARCH_SUMMARY
    assert [m.name for m in research.milestones] == ["sources-gathered"]
    assert [run.summary for run in late.unbound_runs] == ["SIDE"]
    assert not views[following - 1].unbound_runs
    assert len(views) > following, "the early subscriber went on following after the research"


async def test_a_child_runs_its_own_agent_tools_on_its_own_timeline(tether, log):
    me = tether.parent(*ASSISTANT)
    result = await me.run_agent_tool("Coordinator", {"parts": ["one", "two"]},
                                     run_id="coordinate-1")
    assert isinstance(result, AgentToolSuccess) and result.summary == "ONE | TWO"

    owner = (await me.inspect("coordinate-1")).as_parent
    assert owner.name != "coordinate-1", "named by its whole path"
    nested = tether.parent(owner.agent, owner.name)
    for index, text in enumerate(["ONE", "TWO"]):
        snapshot = await nested.inspect(f"coordinate-1-part-{index}")
        assert snapshot is not None and snapshot.summary == text
    # The grandchildren are not on the top parent's timeline.
    view = None
    async for view in me.timeline(live=False):  # noqa: B007 - the last view is wanted
        pass
    assert "coordinate-1" in view.runs
    assert not any(run_id.startswith("coordinate-1-part") for run_id in view.runs)
    assert await me.inspect("coordinate-1-part-0") is None


async def test_the_cli_runs_an_agent_and_rejects_bad_arguments(stack, service_env):
    async def cli(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether.cli", *args, env=service_env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
        return process.returncode, out.decode(), err.decode()

    code, out, err = await cli("run", "Researcher", "--parent", "Assistant/cli",
                               "--input", '{"query": "HTTP/3"}', "--run-id", "cli-1")
    assert code == 0, err
    assert json.loads(out)["summary"] == RESEARCH_SUMMARY
    assert "sources-gathered" in err, "the progress line shows the milestone"

    code, out, _ = await cli("inspect", "Assistant/cli", "cli-1")
    assert code == 0 and json.loads(out)["status"] == "completed"
    code, out, _ = await cli("watch", "Assistant/cli", "--once")
    # The agent, status and bar first; the run id last, where a narrow terminal cuts.
    assert code == 0 and "Researcher completed" in out and "sources-gathered · cli-1" in out
    code, out, err = await cli("watch", "Assistant/cli", "--run-id", "no-such-run", "--once")
    assert (code, out) == (1, "")
    assert "tether watch: run no-such-run not found: parent Assistant/cli has no such run" in err
    code, out, _ = await cli("hooks", "Assistant")
    assert code == 0 and "no hook handler has registered for Assistant" in out
    code, out, _ = await cli("run", "Failing", "--parent", "Assistant/cli", "--quiet")
    assert code == 1 and json.loads(out)["status"] == "error"
    code, _, err = await cli("run", "Researcher", "--parent", "Assistant/cli", "--input", "{x")
    assert code == 2 and "not valid JSON" in err
    code, _, err = await cli("cancel", "Assistant/c li", "r1")
    assert code == 2 and "invalid parent name" in err


async def test_a_cleared_run_id_runs_again_with_its_own_hook_call(tether, log):
    """Clearing a run frees its id: the same id requested again, well inside the streams'
    duplicate windows, is a new run with its own child turn, events and finish hook."""
    calls: list[tuple[str, str]] = []
    hooks = tether.hooks(ASSISTANT[0])

    @hooks.on_finish("on_again_done")
    async def on_again_done(run, result):
        calls.append((run.run_id, result.summary))

    async def until_recorded(text: str) -> None:
        """Until the life of the run id that took `text` has its hook call in its ledger."""
        subject = log.subjects.run_events(me.ref, "again-1")
        state = None
        async with asyncio.timeout(30), aclosing(log.follow(subject)) as events:
            async for stored in events:
                state = evolve(state, stored.event).state
                if (state is not None and state.input == {"text": text}
                        and state.finish_delivered("completed", "on_again_done")):
                    return

    me = tether.parent(*ASSISTANT)
    async with hooks.running():
        for text in ["first", "second"]:
            handle = await me.run_agent_tool("Summarizer", {"text": text}, run_id="again-1",
                                             detached={"on_finish": "on_again_done"})
            assert handle.status == "running"
            await until_recorded(text)
            life_seen = await log.last_seq(me.ref, "again-1")
            await me.clear(status=["completed"])
            await wait_for_event(log, "again-1", "run.cleared", after_seq=life_seen)
        third = await me.run_agent_tool("Summarizer", {"text": "third"}, run_id="again-1",
                                        timeout=30)

    assert calls == [("again-1", "FIRST"), ("again-1", "SECOND")]
    assert isinstance(third, AgentToolSuccess) and third.summary == "THIRD"
    types = await events_of(log, "again-1")
    assert types[-4:] == ["run.cleared", "run.requested", "run.running", "run.completed"]
    snapshot = await me.inspect("again-1")
    assert (snapshot.summary, snapshot.detached) == ("THIRD", False)
    async def listed_once() -> bool:
        return [(r.run_id, r.summary) for r in await me.list_runs()] == [("again-1", "THIRD")]

    await eventually(listed_once, timeout=30, interval=0.1)  # the projector catches up


async def test_a_rejected_request_does_not_block_its_run_id(tether, log):
    """A request rejected for a hook nobody registered yet, repeated once the hook is
    registered, is accepted: the rejection did not claim the run id."""
    me = tether.parent(*ASSISTANT)
    rejected = await me.run_agent_tool("Summarizer", {"text": "early"}, run_id="early-1",
                                       detached={"on_finish": "on_early_done"})
    assert rejected.status == "error" and "on_early_done" in rejected.error

    fired = asyncio.Event()
    hooks = tether.hooks(ASSISTANT[0])

    @hooks.on_finish("on_early_done")
    async def on_early_done(run, result):
        fired.set()

    async with hooks.running():
        handle = await me.run_agent_tool("Summarizer", {"text": "early"}, run_id="early-1",
                                         detached={"on_finish": "on_early_done"})
        assert handle.status == "running"
        await asyncio.wait_for(fired.wait(), timeout=30)
    assert (await events_of(log, "early-1"))[:2] == ["run.rejected", "run.requested"]
