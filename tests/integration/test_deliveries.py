"""What an outcome's or a milestone's writer delivers, against a real server: each test
appends events as the writer does (the runner, a cancel, a give-up) and delivers what
they owe with the same `Deliverer` calls. The runner's own use of them:
tests/integration/test_child_runner.py."""

import time

import pytest
from stream_messages import next_messages

from tether.adapters.event_log import EventLog
from tether.contract.messages import FIRST_PUBLICATION_HEADER, ChatMessage, HookMessage
from tether.delivery.deliverer import Deliverer
from tether.delivery.formatters import DefaultFormatters, load_formatters
from tether.delivery.registered_hooks import RegisteredHooks
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import Event, ParentRef
from tether.domain.run_state import RunState
from tether.log import get_logger
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")


def fresh(run_id: str, start_ms: int | None = None) -> RunEvents:
    """A run whose events happen now (or from `start_ms`), as a writer appends them."""
    return RunEvents(run_id, PARENT, id_prefix="runner",
                     start_ms=int(time.time() * 1000) if start_ms is None else start_ms)


@pytest.fixture
async def deliverer(log: EventLog, settings) -> Deliverer:
    registry = await log.jetstream.key_value(log.subjects.registry_bucket)
    await registry.put(f"hook.{PARENT.agent}.on_done", b"{}")
    return Deliverer.of(settings, log, RegisteredHooks(registry), DefaultFormatters(),
                        get_logger(service="deliveries-test"))


async def written(log: EventLog, deliverer: Deliverer, event: Event) -> RunState | None:
    """`event` appended, then what it owes delivered, as its writer does."""
    state, appended = await log.update(event.parent, event.run_id, lambda s: [event])
    for new in appended:
        if new.type == "run.milestone" and deliverer.owes_notification(state, new.data.name):
            [milestone] = [m for m in state.milestones if m.sequence == new.data.sequence]
            await deliverer.notify_milestone(state, milestone)
        await deliverer.deliver_outcome(state, new)
    return (await log.read_run(event.parent, event.run_id)).state


async def chat_count(log: EventLog) -> int:
    return (await log.jetstream.stream_info(log.subjects.chat_stream)).state.messages


async def test_each_outcome_s_writer_publishes_its_hook_once_per_status(log, deliverer):
    run = fresh("h1")
    requested = run.requested(detached=DetachedOptions(on_finish="on_done", notify=True))
    for event in (requested, run.running(), run.interrupted("no-progress"),
                  run.completed("late but done")):
        state = await written(log, deliverer, event)

    messages = await next_messages(log, log.subjects.hook("Assistant", "on_done"), 2)
    hooks = [HookMessage.model_validate_json(m.data) for m in messages]
    assert [h.result.status for h in hooks] == ["interrupted", "completed"]
    assert hooks[1].result.summary == "late but done" and hooks[1].run.run_id == "h1"
    life = state.incarnation
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [f"finish:h1:interrupted:{life}",
                                                            f"finish:h1:completed:{life}"]
    # Fresh outcomes, published by their writers: the handler need not read the ledger.
    assert [m.headers.get(FIRST_PUBLICATION_HEADER) for m in messages] == ["1", "1"]
    assert await chat_count(log) == 0, "on_finish takes precedence over notify"


async def test_a_hook_for_an_outcome_older_than_half_the_duplicate_window_is_not_marked_first(
        log, deliverer, settings):
    # Its append took that long (a broker away): a retry of the reconciler's may have gone
    # out meanwhile, so the handler must look at the ledger.
    run = fresh("h-old", int(time.time() * 1000) - settings.duplicate_window_ms // 2 - 1)
    for event in (run.requested(detached=DetachedOptions(on_finish="on_done")), run.running(),
                  run.completed("done long ago")):
        state = await written(log, deliverer, event)
    [message] = await next_messages(log, log.subjects.hook("Assistant", "on_done"), 1)
    assert message.headers["Nats-Msg-Id"] == f"finish:h-old:completed:{state.incarnation}"
    assert FIRST_PUBLICATION_HEADER not in message.headers


async def test_notify_and_milestones_reach_the_chat_once_each_however_often_owed(
        log, deliverer):
    options = DetachedOptions(notify={"source": "research-bg"}, on_milestones=["drafted"])
    run = fresh("n1")
    for event in (run.requested(detached=options), run.running(), run.milestone("drafted"),
                  run.milestone("other")):
        state = await written(log, deliverer, event)
    assert set(state.ledger.notifications) == {"milestone:drafted"}
    state = await written(log, deliverer, run.completed("all done"))
    # A writer's successor delivers what the ledger still lacks: nothing, twice over.
    for _ in range(2):
        assert await deliverer.deliver_owed(state) == 0

    messages = [ChatMessage.model_validate_json(m.data)
                for m in await next_messages(log, log.subjects.chat(PARENT), 2)]
    assert [(m.role, m.metadata["kind"]) for m in messages] == [("assistant", "milestone"),
                                                               ("user", "finish")]
    assert messages[1].metadata["source"] == "research-bg"
    assert "all done" in messages[1].content
    assert await chat_count(log) == 2
    assert set(state.ledger.notifications) == {"milestone:drafted", "finish:completed"}


async def test_a_successor_delivers_what_a_writer_that_died_first_left_owed(log, deliverer):
    options = DetachedOptions(on_finish="on_done", on_milestones=["drafted"])
    run = fresh("owed")
    await log.append_batch([run.requested(detached=options), run.running(),
                            run.milestone("drafted"), run.completed("done")],
                           expected_last_seq=0)
    state = (await log.read_run(PARENT, "owed")).state
    assert await deliverer.deliver_owed(state) == 2
    [hook] = await next_messages(log, log.subjects.hook("Assistant", "on_done"), 1)
    assert HookMessage.model_validate_json(hook.data).result.summary == "done"
    assert FIRST_PUBLICATION_HEADER not in hook.headers
    after = (await log.read_run(PARENT, "owed")).state
    assert set(after.ledger.notifications) == {"milestone:drafted"}
    # The hook is the handler's to record: owed again until it does, and the stream drops
    # the repeat; the notice is not.
    assert await deliverer.deliver_owed(after) == 1
    assert (await log.jetstream.stream_info(log.subjects.hooks_stream)).state.messages == 1
    assert await chat_count(log) == 1


async def test_overridden_formatters_set_the_text_and_an_empty_one_suppresses_it(log, settings):
    registry = await log.jetstream.key_value(log.subjects.registry_bucket)
    terse = Deliverer(log, RegisteredHooks(registry), load_formatters("examples.formatters:Terse"),
                      get_logger(service="deliveries-test"))
    run = fresh("f1")
    options = DetachedOptions(notify=True, on_milestones=["drafted"])
    for event in (run.requested(detached=options), run.running(), run.milestone("drafted"),
                  run.completed("the answer")):
        state = await written(log, terse, event)
    # The milestone's text was empty: recorded as handled, nothing put on the chat.
    assert "milestone:drafted" in state.ledger.notifications
    assert "finish:completed" in state.ledger.notifications
    [message] = [ChatMessage.model_validate_json(m.data)
                 for m in await next_messages(log, log.subjects.chat(PARENT), 1)]
    assert message.content == "[Researcher] done: the answer"
    assert await chat_count(log) == 1
