"""A run id that names another request's run, over real NATS and Postgres: a request of
another agent type, with other input, or a fork that is not the fork the id names, is
answered with why, never with that run's outcome (which answers another call), and
starts nothing; the same request asked again is still answered by its run."""

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from runner_stack import Stack, running_stack

from tether import ChildAgent, RunContext
from tether.contract.messages import DetachedHandle
from tether.domain.events import RunRequested, RunRunning

DEADLINE_S = 30
RAN: Counter[str] = Counter()


class Researcher(ChildAgent):
    """Answers its query, in two recorded steps."""

    async def run(self, ctx: RunContext, input: Any) -> str:
        RAN[f"Researcher {input.query}"] += 1
        done = ctx.history.steps if ctx.history is not None else {}
        for index in range(2):
            if index not in done:
                await ctx.record_step(index, {"did": f"look {index}"})
        return f"{input.query}: two sources agree"


class Reviewer(ChildAgent):
    async def run(self, ctx: RunContext, input: Any) -> str:
        RAN["Reviewer"] += 1
        return "reviewed"


@pytest.fixture
async def stack(settings, log, pool) -> AsyncIterator[Stack]:
    RAN.clear()
    async with running_stack(settings, log, pool, [Researcher, Reviewer]) as started:
        yield started


async def call(stack: Stack, agent_type: str, input: dict, run_id: str, **options):
    return await asyncio.wait_for(stack.parent.run_agent_tool(agent_type, input, run_id=run_id,
                                                              **options), DEADLINE_S)


async def kinds(stack: Stack, run_id: str) -> Counter[type]:
    history = await stack.tether.read_run(stack.parent.ref, run_id)
    return Counter(type(event) for event in history.events)


async def test_a_run_id_of_another_call_answers_with_why_and_starts_nothing(stack):
    first = await call(stack, "Researcher", {"query": "HTTP/3"}, "r1")
    assert first.ok and first.summary == "HTTP/3: two sources agree", first

    other_agent = await call(stack, "Reviewer", {"query": "HTTP/3"}, "r1")
    assert (other_agent.ok, other_agent.status, other_agent.retryable) == (False, "error", False)
    assert "run id 'r1' is taken by another request's run, of Researcher, not Reviewer" in \
        other_agent.error, other_agent

    other_input = await call(stack, "Researcher", {"query": "QUIC"}, "r1")
    assert not other_input.ok and "with other input" in other_input.error, other_input
    detached = await call(stack, "Researcher", {"query": "QUIC"}, "r1", detached=True)
    assert isinstance(detached, DetachedHandle)
    assert (detached.status, detached.result) == ("error", None), detached
    assert "with other input" in (detached.error or "")

    again = await call(stack, "Researcher", {"query": "HTTP/3"}, "r1")
    assert again.ok and again.summary == "HTTP/3: two sources agree", "the same call again"
    assert RAN == {"Researcher HTTP/3": 1}
    events = await kinds(stack, "r1")
    assert (events[RunRequested], events[RunRunning]) == (1, 1)


async def test_a_fork_id_that_names_another_run_is_not_answered_as_that_fork(stack):
    await call(stack, "Researcher", {"query": "HTTP/3"}, "source")
    await call(stack, "Researcher", {"query": "QUIC"}, "other-source")
    await call(stack, "Researcher", {"query": "HTTP/3"}, "unrelated")

    over_a_run = await asyncio.wait_for(
        stack.parent.fork("source", at="step:1", fork_id="unrelated"), DEADLINE_S)
    assert not over_a_run.ok, over_a_run
    assert "(not a fork), not the fork of source at step:1" in over_a_run.error
    over_itself = await asyncio.wait_for(
        stack.parent.fork("source", at="step:1", fork_id="source"), DEADLINE_S)
    assert not over_itself.ok and "taken by another request's run" in over_itself.error

    made = await asyncio.wait_for(
        stack.parent.fork("source", at="step:1", fork_id="f1"), DEADLINE_S)
    assert made.ok, made
    of_another = await asyncio.wait_for(
        stack.parent.fork("other-source", at="step:1", fork_id="f1", input={"query": "HTTP/3"}),
        DEADLINE_S)
    assert not of_another.ok, of_another
    assert "(a fork of source at step:1), not the fork of other-source" in of_another.error
    same = await asyncio.wait_for(
        stack.parent.fork("source", at="step:1", fork_id="f1"), DEADLINE_S)
    assert same.ok and same.summary == made.summary, "the same fork asked again"
    assert (await stack.state("unrelated")).forked_from is None
    assert RAN == {"Researcher HTTP/3": 3, "Researcher QUIC": 1}
