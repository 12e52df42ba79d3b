"""The deliverer's finish deliveries against the in-memory event log: what it publishes
for a detached run's outcome and what it records in the run's ledger. Its writers' calls
against a real server: tests/integration/test_deliveries.py."""

import json

import pytest

from tether.adapters.deliveries import HeldMark
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    ChatMessage,
    HookMessage,
    LifecycleResult,
)
from tether.delivery.deliverer import OUTCOMES, Deliverer
from tether.delivery.formatters import DefaultFormatters
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import TERMINAL_EVENT_STATUS, ParentRef
from tether.domain.ids import GLOBAL_FINISH_HOOK, finish_message_id
from tether.log import get_logger
from tether.testing import InMemoryEventLog, RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")
DONE = LifecycleResult(status="completed", summary="all done")


class Hooks:
    def __init__(self, *registered: str) -> None:
        self._registered = set(registered)

    async def has(self, parent_agent: str, method: str) -> bool:
        return method in self._registered


class Records:
    """What the application's hook handler marked delivered, or marked it is calling."""

    def __init__(self, *message_ids: str) -> None:
        self._ids = set(message_ids)
        self.marks: dict[str, HeldMark] = {}

    async def recorded(self, parent: ParentRef, method: str, message_id: str) -> bool:
        return message_id in self._ids

    async def held(self, parent: ParentRef, method: str, message_id: str) -> HeldMark | None:
        return self.marks.get(message_id)


def _deliverer(log: InMemoryEventLog, *hooks: str, records: Records | None = None) -> Deliverer:
    return Deliverer(log, Hooks(*hooks), DefaultFormatters(), get_logger(service="test"),
                     records=records)


async def _finished(log: InMemoryEventLog, run_id: str = "r1", **detached):
    run = RunEvents(run_id, PARENT)
    await log.append_batch([run.requested(detached=DetachedOptions(**detached)), run.started(),
                            run.running(), run.completed("all done")], expected_last_seq=0)
    return (await log.read_run(PARENT, run_id)).state


def _events(log: InMemoryEventLog, run_id: str = "r1") -> list[dict]:
    return [json.loads(m.data) for m in log.messages(
        log.subjects.events_stream, log.subjects.run_events(PARENT, run_id))]


@pytest.fixture
def log() -> InMemoryEventLog:
    return InMemoryEventLog()


async def test_a_finish_hook_is_published_with_its_deterministic_id(log):
    state = await _finished(log, on_finish="on_done")
    deliverer = _deliverer(log)

    assert await deliverer.deliver_finish(state, DONE, first=True) == 1
    assert await deliverer.deliver_finish(state, DONE) == 1  # dropped by the stream

    [hook] = log.messages(log.subjects.hooks_stream)
    assert hook.subject == log.subjects.hook("Assistant", "on_done")
    assert hook.headers["Nats-Msg-Id"] == finish_message_id(state, "completed", "on_done")
    assert hook.headers[FIRST_PUBLICATION_HEADER] == "1"
    message = HookMessage.model_validate_json(hook.data)
    assert (message.method, message.result.summary) == ("on_done", "all done")
    # The hook's delivery is the handler's to record, not the deliverer's.
    assert [e["type"] for e in _events(log)][-1] == "run.completed"


async def test_the_parents_global_finish_hook_goes_out_beside_its_own(log):
    state = await _finished(log, on_finish="on_done")

    assert await _deliverer(log, GLOBAL_FINISH_HOOK).deliver_finish(state, DONE) == 2
    assert sorted(m.subject.rsplit(".", 1)[-1] for m in log.messages(log.subjects.hooks_stream)) \
        == [GLOBAL_FINISH_HOOK, "on_done"]


async def test_a_chat_notification_is_put_once_and_recorded_in_the_ledger(log):
    state = await _finished(log, notify=True)
    deliverer = _deliverer(log)

    assert await deliverer.deliver_finish(state, DONE) == 1
    [chat] = log.messages(log.subjects.chat_stream)
    message = ChatMessage.model_validate_json(chat.data)
    assert message.content.endswith("completed: all done")
    assert _events(log)[-1]["type"] == "run.notified"

    after = (await log.read_run(PARENT, "r1")).state
    assert await deliverer.deliver_finish(after, DONE) == 0
    assert len(log.messages(log.subjects.chat_stream)) == 1
    assert [e["type"] for e in _events(log)].count("run.notified") == 1


async def test_a_retry_finds_the_handlers_record_and_writes_the_ledger_instead(log):
    state = await _finished(log, on_finish="on_done")
    delivered = finish_message_id(state, "completed", "on_done")

    published = await _deliverer(log, records=Records(delivered)).deliver_finish(
        state, DONE, retry=1)

    assert published == 0
    assert log.messages(log.subjects.hooks_stream) == []
    last = _events(log)[-1]
    assert (last["type"], last["data"]["message_id"]) == ("run.finish_delivered", delivered)


async def test_a_retry_without_a_record_gets_a_new_message_id(log):
    state = await _finished(log, on_finish="on_done")

    assert await _deliverer(log, records=Records()).deliver_finish(state, DONE, retry=2) == 1
    [hook] = log.messages(log.subjects.hooks_stream)
    assert hook.headers["Nats-Msg-Id"].endswith(":retry2")
    assert FIRST_PUBLICATION_HEADER not in hook.headers


async def test_a_retry_publishes_no_copy_while_the_handler_renews_its_mark_of_the_call(log):
    state = await _finished(log, on_finish="on_done")
    records = Records()
    records.marks[finish_message_id(state, "completed", "on_done")] = HeldMark(
        lease_ms=60_000, revision=3)
    deliverer = _deliverer(log, records=records)

    # On its way all the same: the handler's consumer brings it back until it is acked.
    assert await deliverer.deliver_finish(state, DONE, retry=1) == 1
    records.marks[finish_message_id(state, "completed", "on_done")] = HeldMark(
        lease_ms=60_000, revision=4)
    assert await deliverer.deliver_finish(state, DONE, retry=2) == 1

    assert log.messages(log.subjects.hooks_stream) == []
    assert [e["type"] for e in _events(log)][-1] == "run.completed"


async def test_a_notification_for_a_cleared_life_is_not_recorded_in_the_next(log):
    state = await _finished(log, notify=True)
    # Cleared, and requested again, before the deliverer got to the first life's outcome.
    await log.append(RunEvents("r1", PARENT, id_prefix="life-1").cleared(), expected_last_seq=4)
    again = RunEvents("r1", PARENT, id_prefix="life-2")
    await log.append(again.requested(detached=DetachedOptions(notify=True)),
                     expected_last_seq=5)

    await _deliverer(log).deliver_finish(state, DONE)

    assert [e["type"] for e in _events(log)][-2:] == ["run.cleared", "run.requested"]


def test_the_outcomes_the_deliverer_delivers_are_the_terminal_events():
    assert {cls.type for cls in OUTCOMES} == set(TERMINAL_EVENT_STATUS)
