"""An awaited run the parent accepted while no child-runner of its agent type runs, over
real NATS and Postgres: the caller is told once what it waits for, and the run goes on
once a runner starts."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.client.link import AwaitTiming
from tether.contract.messages import ChildInspectRequest

DEADLINE_S = 30


class Summarizer(ChildAgent):
    hold: asyncio.Event | None = None  # a run of "held" waits for it

    async def run(self, ctx: RunContext, input: Any) -> str:
        if input.text == "held" and Summarizer.hold is not None:
            await Summarizer.hold.wait()
        return f"summary of {input.text}"


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    Summarizer.hold = None
    async with running_stack(settings, log, pool, [Summarizer], runner=False) as started:
        started.tether.awaiting = AwaitTiming(untaken_after_s=0.3)
        yield started


async def test_a_run_no_runner_takes_says_so_once_and_goes_on_when_one_starts(stack):
    said: list[str] = []
    told = asyncio.Event()

    def on_waiting(text: str) -> None:
        said.append(text)
        told.set()

    call = asyncio.create_task(stack.parent.run_agent_tool(
        "Summarizer", {"text": "the RFC"}, run_id="s1", on_waiting=on_waiting))
    await asyncio.wait_for(told.wait(), DEADLINE_S)
    subject = stack.tether.subjects.inspect_child("Summarizer")
    assert said == [(f"run s1: the parent accepted it and it waits until a child-runner takes "
                     f"it; no child-runner of Summarizer runs (none answered on {subject})")]
    assert not call.done()

    await stack.start_runner()
    result = await asyncio.wait_for(call, DEADLINE_S)
    assert result.ok and result.summary == "summary of the RFC", result
    assert len(said) == 1, "said once"


async def test_a_run_waiting_for_a_busy_runner_says_nothing(stack):
    # One slot, held by another run: s2 waits, started by nobody, while a runner runs.
    stack.settings = stack.settings.model_copy(update={"runner_concurrency": 1})
    await stack.start_runner()
    looked = asyncio.Event()

    async def probe_seen(msg) -> None:
        if ChildInspectRequest.model_validate_json(msg.data).run_id == "s2":
            looked.set()

    probes = await stack.tether.nc.subscribe(stack.tether.subjects.inspect_child("Summarizer"),
                                             cb=probe_seen)
    said: list[str] = []
    Summarizer.hold = asyncio.Event()
    holding = asyncio.create_task(stack.parent.run_agent_tool(
        "Summarizer", {"text": "held"}, run_id="s1"))
    waiting = asyncio.create_task(stack.parent.run_agent_tool(
        "Summarizer", {"text": "the RFC"}, run_id="s2", on_waiting=said.append))
    await asyncio.wait_for(looked.wait(), DEADLINE_S)  # its look was made, and answered
    Summarizer.hold.set()
    results = await asyncio.wait_for(asyncio.gather(holding, waiting), DEADLINE_S)
    await probes.unsubscribe()
    assert all(result.ok for result in results), results
    assert said == []
