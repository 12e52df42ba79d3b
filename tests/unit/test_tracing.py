"""Tracing without servers: when it is on, the spans of an agent's model and tool calls
after the GenAI conventions, and the context in a message's headers."""

import os
import subprocess
import sys
from typing import Any

import pytest
from pydantic import BaseModel
from spans import named, one, parent_of, recorded_spans

from tether import tracing
from tether.agents import Agent, AgentDefinition, Reply, ScriptedModelClient, TokenUsage, tool
from tether.agents.tools import ToolContext


@pytest.mark.parametrize(("environ", "asked"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "svc"}, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "TRUE"}, False),
])
def test_traces_are_exported_only_when_the_variables_ask(environ, asked) -> None:
    assert tracing.requested_by_environment(environ) is asked


def test_tracing_is_off_by_default_and_stays_off_when_nothing_asks() -> None:
    assert tracing.ENABLED is False
    assert tracing.configure("tether-test", {}) is False
    assert tracing.ENABLED is False


def test_a_service_exports_to_the_exporter_the_variables_name() -> None:
    """A process configured only by OTEL_* variables (the console exporter, a service
    name): its span comes out with that resource."""
    script = ("from tether import tracing\n"
              "assert tracing.configure('tether-default')\n"
              "with tracing.span('invoke_agent Researcher', tracing.INTERNAL,"
              " attributes={'gen_ai.agent.name': 'Researcher'}):\n"
              "    pass\n"
              "tracing.shutdown()\n")
    environ = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    environ |= {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "tether-parent-eu"}
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True,
                          text=True, timeout=60, check=True)
    assert '"name": "invoke_agent Researcher"' in done.stdout
    assert '"service.name": "tether-parent-eu"' in done.stdout
    assert '"gen_ai.agent.name": "Researcher"' in done.stdout


def test_the_context_goes_into_headers_and_a_receivers_span_continues_it() -> None:
    with recorded_spans() as spans:
        with tracing.span("send x", tracing.PRODUCER):
            headers = tracing.inject({"Nats-Msg-Id": "1"})
        assert headers["Nats-Msg-Id"] == "1" and headers["traceparent"].startswith("00-")
        with tracing.span("process x", tracing.CONSUMER, carrier=headers):
            pass
    sent, processed = one(spans, "send x"), one(spans, "process x")
    assert processed.context.trace_id == sent.context.trace_id
    assert parent_of(processed) == sent.context.span_id


def test_an_error_leaving_a_span_is_recorded_with_its_type() -> None:
    with recorded_spans() as spans, pytest.raises(KeyError), tracing.span("execute_tool broken"):
        raise KeyError("x")
    failed = one(spans, "execute_tool broken")
    assert failed.attributes["error.type"] == "KeyError"
    assert failed.status.status_code.name == "ERROR"


class Amount(BaseModel):
    amount: int


@tool
async def pay(ctx: ToolContext, input: Amount) -> str:
    """Pay a small amount."""
    return f"paid {input.amount}"


def cashier(client: ScriptedModelClient) -> Agent:
    return Agent(AgentDefinition(id="cashier", model="small-1", tools=(pay,)), client=client)


def script() -> list[Reply]:
    return [Reply("Paying.", [("pay", {"amount": 3})],
                  usage=TokenUsage(input_tokens=40, output_tokens=7, total_tokens=47)),
            Reply("Paid 3.", usage=TokenUsage(input_tokens=52, output_tokens=3, total_tokens=55))]


async def test_an_agents_model_and_tool_calls_are_genai_spans() -> None:
    with recorded_spans() as spans, tracing.span("invoke_agent cashier") as root:
        result = await cashier(ScriptedModelClient(script())).run("pay 3")
    assert result.output == "Paid 3."
    chats = named(spans, "chat small-1")
    assert [(c.attributes["gen_ai.usage.input_tokens"], c.attributes["gen_ai.usage.output_tokens"])
            for c in chats] == [(40, 7), (52, 3)]
    for chat in chats:
        attributes: dict[str, Any] = dict(chat.attributes)
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"] == "small-1"
        assert attributes["gen_ai.provider.name"] == "scripted"
        assert chat.kind.name == "CLIENT"
    call = one(spans, "execute_tool pay")
    assert call.kind.name == "INTERNAL"
    assert {key: call.attributes[key] for key in ("gen_ai.operation.name", "gen_ai.tool.name",
                                                  "gen_ai.tool.type")} == {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "pay",
        "gen_ai.tool.type": "function"}
    assert call.attributes["gen_ai.tool.call.id"] == result.steps[0].tool_results[0].tool_call_id
    root_id = root.get_span_context().span_id
    assert {parent_of(span) for span in [*chats, call]} == {root_id}
    # In the order they ran: a model turn, its tool call, the next model turn.
    assert [s.name for s in sorted([*chats, call], key=lambda s: s.start_time)] == [
        "chat small-1", "execute_tool pay", "chat small-1"]


async def test_with_tracing_off_nothing_of_it_runs(monkeypatch) -> None:
    def refused(*args, **kwargs):
        raise AssertionError("tracing ran while off")

    for name in ("span", "inject", "invoke_agent_attributes", "messaging_attributes"):
        monkeypatch.setattr(tracing, name, refused)
    result = await cashier(ScriptedModelClient(script())).run("pay 3")
    assert result.output == "Paid 3."
