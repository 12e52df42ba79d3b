"""One run's trace across processes, over real NATS and Postgres: the application's
request, the parent service, the work item, the child-runner (its model and tool calls),
the finish hook's publication and the application's hook handler, each continuing the
context the message before it carried in its headers. The services run in this process
(one in-memory exporter sees every span), started before the application's span, so the
context reaches each only through the messages."""

import asyncio

import pytest
from eventually import eventually
from pydantic import BaseModel
from spans import named, one, parent_of, recorded_spans

from tether import tracing
from tether.agent_registry import AgentRegistry
from tether.agents import AgentDefinition, ModelAgent, Reply, ScriptedModelClient, TokenUsage
from tether.agents import tool as as_tool
from tether.agents.tools import ToolContext
from tether.client import connect
from tether.log import get_logger
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent

PARENT_AGENT = "Assistant"


class Amount(BaseModel):
    amount: int


@as_tool
async def pay(ctx: ToolContext, input: Amount) -> str:
    """Pay a small amount."""
    return f"paid {input.amount}"


class Cashier(ModelAgent):
    definition = AgentDefinition(id="cashier", model="till-2", max_steps=3, tools=(pay,))
    model_client = ScriptedModelClient([])


def script() -> list[Reply]:
    return [Reply("Paying.", [("pay", {"amount": 3})],
                  usage=TokenUsage(input_tokens=40, output_tokens=7, total_tokens=47)),
            Reply("Paid 3.", usage=TokenUsage(input_tokens=52, output_tokens=3, total_tokens=55))]


@pytest.fixture
async def services(settings, log, pool, nc, monkeypatch):
    monkeypatch.setattr(Cashier, "model_client", ScriptedModelClient(script()))
    registry = AgentRegistry([Cashier])
    runner = await open_runner(nc, settings, registry, fetch_timeout_s=0.3, cancel_grace_s=0.2)
    parent = await open_parent(settings, log, pool, registry, get_logger(service="parent-test"))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(runner.run(stop)), asyncio.create_task(parent.run(stop))]
    yield
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)


async def test_one_runs_spans_share_one_trace_from_the_request_to_the_hook(settings, services):
    with recorded_spans() as spans:
        async with connect(settings=settings) as tether:
            hooks = tether.hooks(PARENT_AGENT)
            called = asyncio.Event()
            hooks.register("on_paid", lambda run, result: called.set())
            async with hooks.running():
                me = tether.parent(PARENT_AGENT, "user-1")
                handle = await me.run_agent_tool(
                    "Cashier", {"input": "pay 3"}, detached={"on_finish": "on_paid"})
                assert handle.status == "running", handle
                await asyncio.wait_for(called.wait(), 15)
                hook_span = f"process {settings.subjects.hook(PARENT_AGENT, 'on_paid')}"
                record_span = f"process {settings.subjects.command('delivered')}"
                # (the hook's span ends as its handler returns, after the function; the
                # parent then handles the delivery record the handler sent)
                await eventually(lambda: named(spans, hook_span) and named(spans, record_span))

        (request,) = [s for s in named(spans, "invoke_agent Cashier")  # the application's
                      if s.kind.name == "CLIENT"]
        assert request.attributes["tether.run.id"] == handle.run_id
        command = one(spans, f"process {settings.subjects.command('run')}")
        (child,) = [s for s in named(spans, "invoke_agent Cashier")  # the runner's
                    if s.kind.name == "INTERNAL"]
        chats = named(spans, "chat till-2")
        tool = one(spans, "execute_tool pay")
        sent = one(spans, f"send {settings.subjects.hook(PARENT_AGENT, 'on_paid')}")
        hook = one(spans, hook_span)
        # The hook's delivery record, a command the handler sends: the same trace too.
        recorded = one(spans, record_span)

    trace_id = request.context.trace_id
    for span in (command, child, *chats, tool, sent, hook):
        assert span.context.trace_id == trace_id, span.name
    # Each hop's parent is the span that sent the message it received.
    assert parent_of(command) == request.context.span_id
    assert parent_of(child) == command.context.span_id
    assert {parent_of(span) for span in (*chats, tool)} == {child.context.span_id}
    # The runner that appended the outcome publishes its hook, in the child's span.
    assert parent_of(sent) == child.context.span_id
    assert parent_of(hook) == sent.context.span_id
    assert recorded.context.trace_id == trace_id
    assert child.attributes["gen_ai.agent.name"] == "Cashier"
    assert child.attributes["tether.run.id"] == handle.run_id
    assert child.attributes["tether.outcome"] == "completed"
    assert [(c.attributes["gen_ai.usage.input_tokens"], c.attributes["gen_ai.usage.output_tokens"])
            for c in chats] == [(40, 7), (52, 3)]
    assert hook.kind.name == "CONSUMER" and hook.attributes["tether.hook.method"] == "on_paid"


async def test_the_messages_carry_a_traceparent_only_while_tracing(settings, services, log):
    async with connect(settings=settings) as tether:
        me = tether.parent(PARENT_AGENT, "user-2")
        untraced = await me.run_agent_tool("Cashier", {"input": "a"}, detached=True)
        with recorded_spans():
            traced = await me.run_agent_tool("Cashier", {"input": "b"}, detached=True)
        assert not tracing.ENABLED
    for run_id, expected in ((untraced.run_id, False), (traced.run_id, True)):
        # The run's first event, appended by the parent while it handled the command.
        subject = log.subjects.run_events(me.ref, run_id)
        first = await log.jetstream.get_msg(log.subjects.events_stream,
                                            seq=(await log.read_subject(subject))[0].seq)
        assert ("traceparent" in (first.headers or {})) is expected, run_id
