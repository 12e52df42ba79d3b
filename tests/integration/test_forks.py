"""Forks and rewinds over real NATS and Postgres: a fork at step N makes no model call or
tool call of a step before N; a fork with other instructions parts from its original at
N; a fork of a tree reuses the grandchildren that had finished; a failed run, its tool
fixed, is rewound and completes; the same fork asked twice is one fork; a parent forks
its own runs only."""

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from eventually import eventually
from pydantic import BaseModel
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.adapters.postgres.projector import Projector
from tether.agents import AgentDefinition, ModelAgent, ToolContext, tool
from tether.agents.clients.scripted import Reply, ScriptedModelClient
from tether.agents.model_messages import ModelRequest
from tether.client import RunNotFound, agent_tool
from tether.client.arguments import build_run_command
from tether.domain.branches import diff
from tether.domain.commands import ForkRequest
from tether.domain.ids import run_message_id

DEADLINE_S = 30
TOOL_CALLS: Counter[str] = Counter()
WORKED: Counter[int] = Counter()
FIXED = {"pipeline": False}


class Query(BaseModel):
    q: str


@tool
async def search(ctx: ToolContext, input: Query) -> str:
    """Search the web."""
    TOOL_CALLS[input.q] += 1
    return f"3 results for {input.q}"


def answer(request: ModelRequest) -> Reply:
    """The last step's answer: what the instructions ask for."""
    return Reply(text="In brief: QUIC." if "brief" in request.instructions
                 else "HTTP/3 runs over QUIC, which ...")


class Researcher(ModelAgent):
    definition = AgentDefinition(id="researcher", model="m", max_steps=5,
                                 instructions="Research thoroughly.", tools=(search,))
    model_client = ScriptedModelClient([])


class Work(BaseModel):
    n: int


class Worker(ChildAgent):
    """A grandchild: counts the runs it does."""

    description = "Does one piece of work"
    input_model = Work

    async def run(self, ctx: RunContext, input: Work) -> str:
        WORKED[input.n] += 1
        return f"worked {input.n}"


class Lead(ModelAgent):
    """A model child that calls Worker twice, one step each, then answers."""

    definition = AgentDefinition(id="lead", model="m", max_steps=5,
                                 tools=(agent_tool(Worker),))
    model_client = ScriptedModelClient([
        Reply(tool_calls=[("Worker", {"n": 1})]),
        Reply(tool_calls=[("Worker", {"n": 2})]),
        Reply(text="both worked")])


class Pipeline(ChildAgent):
    """Three steps, each recorded; the third one's tool has a bug until it is fixed."""

    follow_ups = frozenset()

    async def run(self, ctx: RunContext, input: Any) -> str:
        done = ctx.history.steps if ctx.history is not None else {}
        for index in range(3):
            if index in done:
                continue
            if index == 2 and not FIXED["pipeline"]:
                raise RuntimeError("the export tool had a bug")
            TOOL_CALLS[f"pipeline-{index}"] += 1
            await ctx.record_step(index, {"did": f"stage {index}"})
        return "exported"


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    TOOL_CALLS.clear()
    WORKED.clear()
    FIXED["pipeline"] = False
    Researcher.model_client = ScriptedModelClient([
        Reply(tool_calls=[("search", {"q": "http3"})]),
        Reply(tool_calls=[("search", {"q": "quic"})]),
        answer])
    Lead.model_client.calls.clear()
    Lead.model_client._attempts.clear()
    async with running_stack(settings, log, pool,
                             [Researcher, Worker, Lead, Pipeline]) as started:
        yield started


async def research(stack: Stack, run_id: str):
    result = await asyncio.wait_for(
        stack.parent.run_agent_tool("Researcher", {"input": "How does HTTP/3 work?"},
                                    run_id=run_id), DEADLINE_S)
    assert result.ok, result
    return result


def model_turns(client: ScriptedModelClient) -> list[int]:
    return [call.turn for call in client.calls]


async def test_a_fork_at_step_n_makes_no_call_of_a_step_before_n(stack):
    await research(stack, "original")
    assert model_turns(Researcher.model_client) == [0, 1, 2]
    assert TOOL_CALLS == {"http3": 1, "quic": 1}

    fork = await asyncio.wait_for(stack.parent.fork("original", at="step:2"), DEADLINE_S)

    assert fork.ok and fork.run_id != "original", fork
    assert model_turns(Researcher.model_client) == [0, 1, 2, 2]  # step 2 only
    assert TOOL_CALLS == {"http3": 1, "quic": 1}
    original, forked = await stack.state("original"), await stack.state(fork.run_id)
    assert forked.forked_from is not None
    assert (forked.forked_from.run.run_id, forked.forked_from.at) == ("original", "step:2")
    assert [forked.steps[i] for i in (0, 1)] == [original.steps[i] for i in (0, 1)]
    assert forked.parent == original.parent  # a sibling of its original

    earlier = await asyncio.wait_for(stack.parent.fork("original", at=1), DEADLINE_S)
    assert earlier.ok, earlier
    assert model_turns(Researcher.model_client)[4:] == [1, 2]  # from step 1 on
    assert TOOL_CALLS == {"http3": 1, "quic": 2}


async def test_a_fork_with_other_instructions_parts_from_its_original_at_that_step(stack):
    await research(stack, "original")

    fork = await asyncio.wait_for(stack.parent.fork(
        "original", at="step:2", agent_overrides={"instructions": "Be brief."}), DEADLINE_S)

    assert fork.ok and fork.summary == "In brief: QUIC.", fork
    # Its output is its own from the fork point: the original's step 2 streamed its text
    # before it was recorded, and that text is not the fork's.
    assert (await stack.state(fork.run_id)).output_text == "In brief: QUIC."
    compared = diff(await stack.state("original"), await stack.state(fork.run_id))
    assert (compared.shared, compared.diverged_at) == (2, 2)
    assert compared.a.summary == "HTTP/3 runs over QUIC, which ..."
    assert Researcher.model_client.requests[-1].instructions == "Be brief."


async def test_overrides_an_agent_does_not_take_are_refused_naming_the_field(stack):
    await research(stack, "original")
    refused = await asyncio.wait_for(stack.parent.fork(
        "original", at="step:2", agent_overrides={"temperature": 2}), DEADLINE_S)
    assert not refused.ok
    assert refused.error.startswith("fork.overrides for Researcher: temperature"), refused
    beyond = await asyncio.wait_for(stack.parent.fork("original", at="step:9"), DEADLINE_S)
    assert not beyond.ok and "the run recorded 3 steps" in beyond.error, beyond


async def test_a_fork_of_a_tree_reuses_the_grandchildren_that_had_finished(stack):
    lead = await asyncio.wait_for(
        stack.parent.run_agent_tool("Lead", {"input": "work"}, run_id="lead"), DEADLINE_S)
    assert lead.ok and WORKED == {1: 1, 2: 1}, lead

    # Its steps: 0 calls worker 1, 1 holds its result, 2 calls worker 2, 3 holds its
    # result, 4 answers. A fork at step 2 reuses worker 1's finished run through step 1.
    fork = await asyncio.wait_for(stack.parent.fork("lead", at="step:2"), DEADLINE_S)

    assert fork.ok and fork.summary == "both worked", fork
    assert WORKED == {1: 1, 2: 2}  # worker 1's result was reused, worker 2 ran again
    below = (await stack.state(fork.run_id)).as_parent()
    assert (await stack.tether.read_run(below, "agent-tool:call_1_0")).state.status == (
        "completed")
    assert (await stack.tether.read_run(below, "agent-tool:call_0_0")).state is None


async def test_a_failed_run_is_rewound_once_its_tool_is_fixed_and_completes(stack):
    failed = await asyncio.wait_for(
        stack.parent.run_agent_tool("Pipeline", {}, run_id="export"), DEADLINE_S)
    assert not failed.ok and failed.error.endswith("the export tool had a bug"), failed
    refused = await asyncio.wait_for(stack.parent.rewind("export"), DEADLINE_S)
    assert not refused.ok and failed.error in refused.error  # not fixed: fails again

    FIXED["pipeline"] = True
    rewound = await asyncio.wait_for(stack.parent.rewind("export"), DEADLINE_S)

    assert rewound.ok and rewound.run_id == "export" and rewound.summary == "exported", rewound
    assert TOOL_CALLS == {"pipeline-0": 1, "pipeline-1": 1, "pipeline-2": 1}
    state = await stack.state("export")
    assert (state.status, state.rewinds, sorted(state.steps)) == ("completed", 2, [0, 1, 2])
    # Asked again, the last rewind answers with its outcome, and nothing runs again.
    again = await asyncio.wait_for(stack.parent.rewind("export"), DEADLINE_S)
    assert again.ok and again.summary == "exported", again
    assert TOOL_CALLS == {"pipeline-0": 1, "pipeline-1": 1, "pipeline-2": 1}
    # A run that never failed is not rewound, and says why.
    done = await asyncio.wait_for(
        stack.parent.run_agent_tool("Pipeline", {}, run_id="fine"), DEADLINE_S)
    assert done.ok, done
    refused = await asyncio.wait_for(stack.parent.rewind("fine"), DEADLINE_S)
    assert not refused.ok and refused.error == (
        "run fine is completed: only a failed run is rewound (fork it to run it again from "
        "a step)"), refused


async def test_the_same_fork_asked_twice_is_one_fork(stack):
    await research(stack, "original")
    first = await asyncio.wait_for(stack.parent.fork("original", at="step:2"), DEADLINE_S)
    second = await asyncio.wait_for(stack.parent.fork("original", at="step:2"), DEADLINE_S)

    assert first.ok and second.ok and first.run_id == second.run_id
    assert model_turns(Researcher.model_client) == [0, 1, 2, 2]
    events = (await stack.tether.read_run(stack.parent.ref, first.run_id)).events
    assert [e.type for e in events].count("run.requested") == 1


async def test_only_the_runs_parent_may_fork_it(stack):
    await research(stack, "original")
    stranger = stack.tether.parent("Assistant", "someone-else")
    with pytest.raises(RunNotFound, match="a parent forks its own runs only"):
        await stranger.fork("original", at="step:1")
    # A fork asked for anyway names a run the stranger does not have: refused.
    command = build_run_command(stranger.ref, "Researcher", {"input": "x"}, run_id="stolen",
                                parent_tool_call_id=None, display_order=None, display=None,
                                detached=False,
                                fork=ForkRequest(run_id="original", at="step:1"))
    await stack.tether.publish_command("run", command, run_message_id("stolen", 0, stranger.ref))

    async def rejection():
        events = (await stack.tether.read_run(stranger.ref, "stolen")).events
        return next((e for e in events if e.type == "run.rejected"), None)

    rejected = await eventually(rejection, timeout=DEADLINE_S)
    assert rejected.data.code == "no-such-run"
    assert "no run 'original' of Assistant/someone-else" in rejected.data.error
    assert model_turns(Researcher.model_client) == [0, 1, 2]


async def tether_cli(settings: Any, *args: str) -> tuple[int, str, str]:
    """The `tether` command in its own process, on this test's servers and prefix."""
    env = {**os.environ, "TETHER_NATS_URL": settings.nats_url,
           "TETHER_DATABASE_URL": settings.database_url,
           "TETHER_PROJECTION_SCHEMA": settings.projection_schema,
           "TETHER_PREFIX": settings.prefix}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=DEADLINE_S)
    return process.returncode, out.decode(), err.decode()


async def test_the_cli_forks_rewinds_and_compares_runs(stack, settings, log, pool):
    await research(stack, "original")
    code, out, err = await tether_cli(settings, "runs", "fork", "Assistant/remote", "original",
                                      "--at", "step:2", "--instructions", "Be brief.")
    assert code == 0, err
    fork = json.loads(out)
    assert fork["ok"] and fork["summary"] == "In brief: QUIC.", fork
    code, _, err = await tether_cli(settings, "runs", "fork", "Assistant/remote", "original",
                                    "--at", "chapter:2")
    assert code == 2 and "--at: expected step:<n>, milestone:<name> or seq:<n>" in err, err

    failed = await stack.parent.run_agent_tool("Pipeline", {}, run_id="export")
    assert not failed.ok
    FIXED["pipeline"] = True
    code, out, err = await tether_cli(settings, "runs", "rewind", "Assistant/remote", "export")
    assert code == 0 and json.loads(out)["summary"] == "exported", (out, err)

    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    await asyncio.wait_for(projector.wait_for_position(await log.stream_last_seq()), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    code, out, err = await tether_cli(settings, "runs", "diff", "original", fork["run_id"],
                                      "--parent", "Assistant/remote")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("a  original  Researcher  completed  3 steps")
    assert "forked from original at sequence" in lines[1]
    assert "the same for the first 2; they part at step 2" in out
    assert "output a  HTTP/3 runs over QUIC, which ..." in out
    assert "output b  In brief: QUIC." in out
    code, _, err = await tether_cli(settings, "runs", "diff", "original", "nope",
                                    "--parent", "Assistant/remote")
    assert code == 1 and "no run 'nope' of Assistant/remote" in err


async def test_a_fork_at_a_sequence_past_the_runs_last_event_is_refused(stack):
    await research(stack, "original")
    last = (await stack.tether.read_run(stack.parent.ref, "original")).last_seq

    beyond = await asyncio.wait_for(
        stack.parent.fork("original", at=f"seq:{last + 1_000}"), DEADLINE_S)

    assert not beyond.ok, beyond
    assert f"is past the run's last event (sequence {last})" in beyond.error, beyond
    assert model_turns(Researcher.model_client) == [0, 1, 2]  # nothing ran again
    at_the_end = await asyncio.wait_for(stack.parent.fork("original", at=f"seq:{last}"),
                                        DEADLINE_S)
    assert at_the_end.ok, at_the_end


async def test_a_fork_keeps_its_originals_budget(stack):
    budgeted = await asyncio.wait_for(stack.parent.run_agent_tool(
        "Worker", {"n": 7}, run_id="budgeted", max_tokens=5_000, max_cost=1.5), DEADLINE_S)
    assert budgeted.ok, budgeted
    fork = await asyncio.wait_for(stack.parent.fork("budgeted", at="step:0"), DEADLINE_S)
    assert fork.ok, fork
    forked = await stack.state(fork.run_id)
    assert (forked.max_tokens, forked.max_cost) == (5_000, 1.5)
