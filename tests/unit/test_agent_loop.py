"""The agent loop with the scripted client: tools, step limits, stop conditions, usage,
retries, failures, streams and resuming from step records — no servers."""

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from tether.agents import (
    Agent,
    AgentDefinition,
    AgentStepRecord,
    Fail,
    Message,
    ModelError,
    ModelPrice,
    ModelRetry,
    PriceTable,
    Reply,
    Sampling,
    ScriptedModelClient,
    TokenUsage,
    ToolContext,
    step_count_is,
    tool,
    tool_called,
)
from tether.agents.loop import AgentLoop
from tether.agents.loop_ports import CallPlan, LoopPorts, Session
from tether.agents.model_messages import ModelRequest, ModelResponse
from tether.agents.tools import StateAccessor


class Query(BaseModel):
    query: str


class Note(BaseModel):
    text: str


executed: list[str] = []


@tool
async def search(ctx: ToolContext, input: Query) -> dict[str, Any]:
    """Search the web."""
    executed.append(f"search:{input.query}")
    ctx.state.set("searches", ctx.state.get("searches", 0) + 1)
    return {"hits": [f"{input.query} is fast"]}


@tool
async def final_answer(ctx: ToolContext, input: Note) -> str:
    """Give the final answer."""
    return input.text


def definition(**overrides: Any) -> AgentDefinition:
    values: dict[str, Any] = {"id": "researcher", "model": "small-1",
                              "instructions": "Answer briefly.", "tools": (search, final_answer)}
    return AgentDefinition(**(values | overrides))


def searching(n: int) -> Reply:
    return Reply(f"Searching {n}.", [("search", {"query": f"q{n}"})])


class SleepRecorder:
    def __init__(self) -> None:
        self.delays_ms: list[int] = []

    async def __call__(self, seconds: float) -> None:
        self.delays_ms.append(round(seconds * 1000))


@pytest.fixture(autouse=True)
def _reset_executed() -> None:
    executed.clear()


async def test_a_multi_step_tool_loop_runs_to_the_answer() -> None:
    client = ScriptedModelClient([searching(1), searching(2), Reply("HTTP/3 is fast.")])
    agent = Agent(definition(), client=client)
    events = []
    result = await agent.run("Is HTTP/3 fast?", on_event=events.append, state={"searches": 0})

    assert (result.status, result.output, result.stop_reason) == ("completed", "HTTP/3 is fast.",
                                                                  None)
    assert executed == ["search:q1", "search:q2"]
    assert result.state == {"searches": 2}
    assert [(s.index, s.kind, s.status) for s in result.steps] == [
        (0, "model_turn", "running"), (1, "model_turn", "running"), (2, "model_turn", "completed")]
    assert result.steps[0].tool_results[0].content == '{"hits": ["q1 is fast"]}'
    assert [m.role for m in result.messages] == ["user", "assistant", "tool", "assistant", "tool",
                                                "assistant"]
    assert [i.type for i in result.items] == [
        "message", "message", "tool_call", "tool_result", "message", "tool_call", "tool_result",
        "message", "final_output"]
    assert [s.text for s in result.step_results] == ["Searching 1.", "Searching 2.",
                                                     "HTTP/3 is fast."]
    record = result.record
    assert (record.model, record.max_steps, record.calls, record.status) == (
        "small-1", 10, 1, "completed")
    assert record.duration_ms is not None and record.duration_ms >= 0
    # The model saw the instructions, the tools as JSON Schema and the growing conversation.
    second = client.requests[1]
    assert second.instructions == "Answer briefly."
    assert [t.id for t in second.tools] == ["search", "final_answer"]
    assert second.tools[0].parameters == Query.model_json_schema()
    assert [m.role for m in second.messages] == ["user", "assistant", "tool"]
    text = "".join(e.text for e in events if e.type == "text_delta")
    assert text == "Searching 1.\n\nSearching 2.\n\nHTTP/3 is fast."
    assert events[0].type == "run_started" and events[-1].type == "run_finished"


async def test_the_step_limit_applies_to_the_run_and_to_each_continue_call() -> None:
    client = ScriptedModelClient([searching(n) for n in range(5)] + [Reply("done")])
    agent = Agent(definition(max_steps=2), client=client)
    first = await agent.run("go")
    assert (first.status, first.stop_reason, len(first.steps)) == ("stopped", "max_steps", 2)
    assert first.steps[-1].stop_reason == "max_steps"

    second = await agent.continue_run(first)
    assert (second.status, second.stop_reason, len(second.steps)) == ("stopped", "max_steps", 4)
    assert [s.call for s in second.steps] == [0, 0, 1, 1]

    third = await agent.continue_run(second, max_steps=5)
    assert (third.status, third.output, third.record.max_steps) == ("completed", "done", 5)
    assert third.record.calls == 3 and len(third.steps) == 6


async def test_a_stop_condition_ends_the_run_as_stopped_with_its_reason() -> None:
    client = ScriptedModelClient([searching(1), Reply("", [("final_answer", {"text": "42"})]),
                                  Reply("never asked")])
    agent = Agent(definition(stop_when=(tool_called("final_answer"),)), client=client)
    result = await agent.run("what is it?")
    assert (result.status, result.stop_reason) == ("stopped", "tool final_answer was called")
    assert len(client.calls) == 2
    assert result.steps[-1].tool_results[0].content == "42"

    by_count = Agent(definition(stop_when=(step_count_is(1),)),
                     client=ScriptedModelClient([searching(1), searching(2)]))
    assert (await by_count.run("go")).stop_reason == "step count reached 1"

    def budget(state: Any) -> tuple[bool, str]:
        return state.usage.total_tokens > 0, "token budget spent"

    custom = Agent(definition(stop_when=(budget,)), client=ScriptedModelClient([searching(1)]))
    assert (await custom.run("go")).stop_reason == "token budget spent"


async def test_usage_and_cost_are_summed_from_the_price_table() -> None:
    usage = TokenUsage(input_tokens=1000, output_tokens=200, cached_tokens=400)
    prices = PriceTable.of({"small-1": ModelPrice(input_per_million=2.0, output_per_million=8.0,
                                                  cached_input_per_million=0.5)})
    client = ScriptedModelClient([Reply("a", [("search", {"query": "x"})], usage=usage),
                                  Reply("b", usage=usage)])
    result = await Agent(definition(prices=prices), client=client).run("go")
    assert result.usage.model_dump() == {"input_tokens": 2000, "output_tokens": 400,
                                         "cached_tokens": 800, "total_tokens": 2400,
                                         "cost": pytest.approx(2 * (600 * 2 + 400 * 0.5 + 200 * 8)
                                                               / 1_000_000)}
    assert [s.cost for s in result.steps] == [pytest.approx(0.003), pytest.approx(0.003)]

    unpriced = await Agent(definition(), client=ScriptedModelClient([Reply("a", usage=usage)])
                           ).run("go", model="openai/small-2")
    assert unpriced.usage.cost is None and unpriced.record.model == "openai/small-2"


async def test_a_retryable_error_is_retried_with_backoff_and_retry_after() -> None:
    sleep = SleepRecorder()
    overloaded = ModelError("overloaded", status=503)
    limited = ModelError("slow down", status=429, retry_after_ms=1234)
    client = ScriptedModelClient([[Fail(overloaded), Fail(overloaded), Reply("ok")],
                                  [Fail(limited), Reply("ok again")]])
    agent = Agent(definition(model_retries=ModelRetry(count=2, backoff_ms=100, multiplier=3)),
                  client=client, sleep=sleep)
    events = []
    result = await agent.run("go", on_event=events.append)
    assert (result.status, result.output, result.steps[0].turn.attempts) == ("completed", "ok", 3)
    assert sleep.delays_ms == [100, 300]

    again = await agent.continue_run(result, human_input="and again?")
    assert again.output == "ok again" and again.steps[-1].turn.attempts == 2
    assert sleep.delays_ms == [100, 300, 1234], "Retry-After replaces the backoff"
    assert [e.data["delay_ms"] for e in events if e.type == "model_retry"] == [100, 300]


async def test_retries_run_out_and_a_non_retryable_error_fails_at_once() -> None:
    sleep = SleepRecorder()
    client = ScriptedModelClient([[Fail(ModelError("boom", status=500))] * 5])
    result = await Agent(definition(model_retries=ModelRetry(count=2, backoff_ms=1)),
                         client=client, sleep=sleep).run("go")
    assert (result.status, result.error) == ("failed", "boom")
    assert result.record.error_details["attempts"] == 3
    assert result.record.error_details["status"] == 500
    assert result.steps == () and result.items[-1].type == "error"

    bad = ModelError("unknown parameter 'tempreature'", status=400, code="invalid_request")
    result = await Agent(definition(), client=ScriptedModelClient([[Fail(bad), Reply("never")]]),
                         sleep=sleep).run("go")
    assert result.status == "failed"
    assert result.record.error_details == {
        "kind": "unknown", "message": "unknown parameter 'tempreature'", "status": 400,
        "code": "invalid_request", "attempts": 1, "context_overflow": False}


async def test_a_context_overflow_fails_without_retrying_and_says_so() -> None:
    overflow = ModelError("This model's maximum context length is 8192 tokens", status=400,
                          kind="context_overflow")
    sleep = SleepRecorder()
    result = await Agent(definition(), client=ScriptedModelClient([[Fail(overflow), Reply("x")]]),
                         sleep=sleep).run("go")
    assert result.status == "failed" and sleep.delays_ms == []
    assert result.record.error_details["context_overflow"] is True


async def test_bad_tool_calls_are_answered_with_errors_the_model_can_correct() -> None:
    def check(request: ModelRequest) -> Reply:
        errors = [m.content for m in request.messages if m.role == "tool"]
        return Reply(" | ".join(errors))

    client = ScriptedModelClient([Reply("", [("fetch", {"url": "x"}), ("search", {"q": 1})]),
                                  check])
    result = await Agent(definition(), client=client).run("go")
    assert result.output == ("Error: unknown tool 'fetch'; the tools are: search, final_answer | "
                             "Error: invalid input for search: query: Field required")


async def test_a_failing_tool_is_reported_to_the_model_and_long_output_is_truncated() -> None:
    @tool
    async def flaky(ctx: ToolContext, input: Query) -> str:
        """Fails."""
        raise RuntimeError("disk full")

    @tool
    async def verbose(ctx: ToolContext, input: Query) -> str:
        """Talks a lot."""
        return "a" * 500 + "b" * 500

    client = ScriptedModelClient([Reply("", [("flaky", {"query": "x"}),
                                             ("verbose", {"query": "y"})]), Reply("ok")])
    result = await Agent(definition(tools=(flaky, verbose), max_tool_output_chars=100),
                         client=client).run("go")
    failed, long = result.steps[0].tool_results
    assert (failed.is_error, failed.content) == (True, "Error: RuntimeError: disk full")
    assert long.truncated and len(long.content) == 100
    assert long.content.startswith("aaa") and long.content.endswith("bbb")
    assert "characters truncated" in long.content


async def test_instructions_model_and_sampling_may_be_computed_from_the_run() -> None:
    async def instructions(run: Any) -> str:
        return f"Write for {run.context['audience']}; {run.state.get('searches', 0)} searches."

    client = ScriptedModelClient([searching(1), Reply("done")])
    agent = Agent(definition(instructions=instructions,
                             model=lambda run: "big-1" if run.step else "small-1",
                             sampling=lambda run: Sampling(temperature=0.1 * (run.step + 1))),
                  client=client)
    result = await agent.run("go", context={"audience": "children"})
    assert [r.instructions for r in client.requests] == [
        "Write for children; 0 searches.", "Write for children; 1 searches."]
    assert [r.model for r in client.requests] == ["small-1", "big-1"]
    assert [r.sampling.temperature for r in client.requests] == [0.1, 0.2]
    assert [s.model for s in result.steps] == ["small-1", "big-1"]
    assert result.record.model == "big-1"


async def test_a_stream_is_replayed_from_the_start_for_every_consumer() -> None:
    client = ScriptedModelClient([searching(1), Reply("HTTP/3 runs over QUIC.")])
    stream = Agent(definition(), client=client).stream("go")
    assert stream.status == "queued"

    async def read() -> list[str]:
        return [event.type async for event in stream]

    early = asyncio.create_task(read())
    result = await stream.result()
    late = await read()
    assert await early == late and late[0] == "run_started" and late[-1] == "run_finished"
    assert "".join([chunk async for chunk in stream.text()]) == (
        "Searching 1.\n\nHTTP/3 runs over QUIC.")
    assert result.output == "HTTP/3 runs over QUIC." and stream.status == "completed"


async def test_a_retried_stream_does_not_repeat_text_already_shown() -> None:
    class Stutter:
        calls = 0

        async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
            self.calls += 1
            await on_delta("Hel")
            if self.calls == 1:
                raise ModelError("connection reset", kind="connection")
            await on_delta("lo")
            return ModelResponse(message=Message.assistant("Hello"))

    events = []
    result = await Agent(definition(model_retries=ModelRetry(backoff_ms=0)),
                         client=Stutter()).run("hi", on_event=events.append)
    assert result.output == "Hello"
    assert [e.text for e in events if e.type == "text_delta"] == ["Hel", "lo"]


async def test_a_cancelled_run_stops_between_steps_and_in_a_model_call() -> None:
    cancelled = asyncio.Event()

    class Hanging:
        async def complete(self, request: ModelRequest, on_delta: Any = None) -> ModelResponse:
            cancelled.set()
            await asyncio.Event().wait()

    ports = LoopPorts(client=Hanging(), cancelled=cancelled)
    plan = CallPlan(run_id="r1", call=0, max_steps=3, retry=ModelRetry())
    session = Session(input=(Message.user("go"),), records=[], state=StateAccessor())
    outcome = await asyncio.wait_for(AgentLoop(definition(), ports).drive(session, plan), 1)
    assert outcome.status == "cancelled"


async def test_a_loop_given_recorded_steps_goes_on_after_them_without_calling_again() -> None:
    client = ScriptedModelClient([searching(1), searching(2), Reply("done")])
    first = await Agent(definition(), client=client).run("go")
    # As if the runner died after recording two steps: a new process, a new client.
    recorded = [AgentStepRecord.model_validate(s.model_dump(mode="json"))
                for s in first.steps[:2]]
    assert recorded == list(first.steps[:2]), "a step record survives JSON unchanged"
    executed.clear()
    fresh = ScriptedModelClient([Fail(AssertionError("turn 0 again")),
                                 Fail(AssertionError("turn 1 again")), Reply("done")])
    replayed_text: list[tuple[str, bool]] = []

    async def sink(text: str, replayed: bool) -> None:
        replayed_text.append((text, replayed))

    session = Session(input=first.input, records=recorded,
                      state=StateAccessor(recorded[-1].state))
    plan = CallPlan(run_id=first.run_id, call=0, max_steps=10, retry=ModelRetry())
    outcome = await AgentLoop(definition(), LoopPorts(client=fresh, text=sink)).drive(session,
                                                                                     plan)
    assert outcome.status == "completed" and executed == []
    assert [c.turn for c in fresh.calls] == [2]
    assert replayed_text == [("Searching 1.", True), ("\n\nSearching 2.", True),
                             ("\n\ndone", False)]
    assert session.state.snapshot() == {"searches": 2}
