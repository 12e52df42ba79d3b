"""Client calls that wait, over real NATS: each says what it waits for and ends when
waiting can no longer help. A run whose outcome this client cannot decode (a newer
Tether's event), a rewind or a follow-up that no parent service takes, and a steering
message that none records."""

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from tether.adapters.event_log import EventLog
from tether.client import MessageRefused, Tether, UnreadableOutcome, connect
from tether.client.link import AwaitTiming
from tether.contract.codec import encode_event
from tether.contract.messages import DetachedHandle
from tether.domain.events import Event, ParentRef, RunMessageSent
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")
DEADLINE_S = 10  # far beyond what each call should take
FUTURE_VERSION = 99
FUTURE = f"run.completed: schema_version {FUTURE_VERSION} is newer than this build knows"


@pytest.fixture
async def tether(log: EventLog, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        client.awaiting = AwaitTiming(live_idle_s=0.1, presence_after_s=0.2,
                                      expiry_grace_s=0.5, unreadable_last_s=0.5)
        yield client


async def append_from_the_future(log: EventLog, event: Event) -> int:
    """`event` stored as a newer Tether would write it: a schema version this build does
    not know. Its stream sequence."""
    raw = json.loads(encode_event(event))
    raw["schema_version"] = FUTURE_VERSION
    ack = await log.publish(log.subjects.run_events(event.parent, event.run_id),
                            json.dumps(raw).encode(), headers={"Nats-Msg-Id": event.event_id},
                            stream=log.subjects.events_stream)
    return ack.seq


async def appended(log: EventLog, events: list[Event]) -> None:
    for event in events:
        await log.append(event, expected_last_seq=None)


# --- a run whose last message this client cannot read -----------------------------------

async def test_an_outcome_stored_in_a_newer_shape_is_told_and_ends_the_wait(log, tether):
    run = RunEvents("future", PARENT)
    await appended(log, [run.requested(), run.started(), run.running()])
    seq = await append_from_the_future(log, run.completed("done"))
    said: list[str] = []
    with pytest.raises(UnreadableOutcome) as ended:
        await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {"query": "HTTP/3"}, run_id="future", timeout=DEADLINE_S,
            on_waiting=said.append)
    subject = log.subjects.run_events(PARENT, "future")
    assert len(said) == 1, said
    assert said[0].startswith(f"run future: this client cannot read message {seq} of the "
                              f"run's log ({subject}): {FUTURE}"), said
    assert (ended.value.run_id, ended.value.seq) == ("future", seq)
    assert "it may be the run's outcome, written by a newer Tether; upgrade this client" \
        in str(ended.value)


class ActingParent:
    """Stands in for the parent service: once the client's run request is in the commands
    stream, appends what a test gives for it (so it reaches the client live)."""

    def __init__(self, log: EventLog, append) -> None:
        self._log, self._append = log, append
        self.done = asyncio.Event()

    async def __aenter__(self):
        async def on_request(msg: Msg) -> None:
            await self._append()
            self.done.set()

        self._subscription = await self._log.nats.subscribe(
            self._log.subjects.command_for("run", PARENT), cb=on_request)
        await self._log.nats.flush()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._subscription.unsubscribe()


async def test_an_outcome_arriving_live_in_a_newer_shape_is_told_and_ends_the_wait(log, tether):
    tether.awaiting = AwaitTiming(live_idle_s=60.0, unreadable_last_s=0.5)  # live only
    run = RunEvents("live-future", PARENT)
    seqs: list[int] = []

    async def accept_then_finish_in_a_newer_shape() -> None:
        await appended(log, [run.requested(), run.started()])
        seqs.append(await append_from_the_future(log, run.completed("done")))

    said: list[str] = []
    async with ActingParent(log, accept_then_finish_in_a_newer_shape) as parent:
        with pytest.raises(UnreadableOutcome) as ended:
            await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
                "Researcher", {"query": "HTTP/3"}, run_id="live-future", timeout=DEADLINE_S,
                on_waiting=said.append)
    assert parent.done.is_set()
    assert [line.split(" of the run's log")[0] for line in said] == [
        f"run live-future: this client cannot read message {seqs[0]}"]
    assert ended.value.seq == seqs[0] and FUTURE in ended.value.reason


async def test_a_message_it_cannot_read_before_the_outcome_is_told_and_skipped(log, tether):
    run = RunEvents("gap", PARENT)

    async def with_a_newer_message_midway() -> None:
        await appended(log, [run.requested(), run.started()])
        await append_from_the_future(log, run.output("a newer kind of progress"))
        await appended(log, [run.completed("done")])

    said: list[str] = []
    async with ActingParent(log, with_a_newer_message_midway):
        result = await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {"query": "HTTP/3"}, run_id="gap", timeout=DEADLINE_S,
            on_waiting=said.append)
    assert result.ok and result.summary == "done"
    assert len(said) == 1 and "cannot read message 3 " in said[0], said


async def test_a_detached_request_whose_acceptance_it_cannot_read_ends_the_wait(log, tether):
    run = RunEvents("bg", PARENT)

    async def accept_in_a_newer_shape() -> None:
        await append_from_the_future(log, run.requested())

    said: list[str] = []
    async with ActingParent(log, accept_in_a_newer_shape):
        with pytest.raises(UnreadableOutcome, match="run bg: this client cannot read the "
                                                    "run's last message"):
            await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
                "Researcher", {"query": "HTTP/3"}, run_id="bg", detached=True,
                timeout=DEADLINE_S, on_waiting=said.append)
    assert len(said) == 1 and "run.requested: schema_version 99" in said[0], said


# --- rewinds and follow-ups no parent service takes ----------------------------------------

async def stopped_parent(log: EventLog):
    """A parent service that is stopped (SIGSTOP): subscribed to its queries, answering
    none."""
    async def never_answer(msg: Msg) -> None:
        pass

    subscription = await log.nats.subscribe(log.subjects.rpc_for("has_run", PARENT),
                                            cb=never_answer)
    await log.nats.flush()
    return subscription


@pytest.fixture(params=["no parent", "a stopped parent"])
async def unserved(request, log: EventLog) -> AsyncIterator[str]:
    """What the presence look finds: none subscribed, or one that never answers."""
    if request.param == "no parent":
        yield "no parent service answers"
        return
    subscription = await stopped_parent(log)
    yield "the parent service did not answer"
    await subscription.unsubscribe()


async def a_finished_run(log: EventLog, run_id: str, failed: bool) -> None:
    run = RunEvents(run_id, PARENT)
    ending = run.failed("the source was down") if failed else run.completed("one")
    await appended(log, [run.requested(), run.running(), ending])


class Told:
    """An `on_waiting` that keeps what it is told, and says when it was."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.event = asyncio.Event()

    def __call__(self, text: str) -> None:
        self.said.append(text)
        self.event.set()

    async def first(self, call: asyncio.Task) -> str:
        """The first thing said while `call` waits; the call is cancelled then."""
        await asyncio.wait_for(self.event.wait(), DEADLINE_S)
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert len(self.said) == 1, self.said
        return self.said[0]


async def test_a_rewind_no_parent_takes_says_what_it_waits_for(log, tether, unserved):
    await a_finished_run(log, "failed", failed=True)
    told = Told()
    said = await told.first(asyncio.create_task(tether.parent(PARENT.agent, PARENT.name).rewind(
        "failed", detached=True, on_waiting=told)))
    assert said.startswith("run failed: the request is stored and waits until a parent "
                           f"service takes it; {unserved}"), said


async def test_a_follow_up_no_parent_takes_says_what_it_waits_for(log, tether, unserved):
    await a_finished_run(log, "done", failed=False)
    told = Told()
    said = await told.first(asyncio.create_task(
        tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {"query": "and QUIC?"}, follow_up="done", on_waiting=told)))
    assert said.startswith("run done: the request is stored and waits until a parent service "
                           f"takes it; {unserved}"), said


@pytest.mark.parametrize("detached", [True, False], ids=["detached", "awaited"])
async def test_a_rewind_no_parent_takes_ends_when_it_expires(log, tether, detached):
    await a_finished_run(log, "failed", failed=True)
    said: list[str] = []
    answer = await tether.parent(PARENT.agent, PARENT.name).rewind(
        "failed", detached=detached, expires_in=1, timeout=DEADLINE_S, on_waiting=said.append)
    expired = ("the run request expired: no parent service took it within 1s (its "
               "expires_in), so none will apply it")
    assert answer.error == expired and answer.status == "error"
    assert isinstance(answer, DetachedHandle) == detached
    assert len(said) == 1 and "waits for at most 1s (its expires_in)" in said[0], said


# --- steering messages no parent service records -------------------------------------------

async def an_open_run(log: EventLog) -> None:
    run = RunEvents("long", PARENT)
    await appended(log, [run.requested(), run.started(), run.running()])


async def test_a_message_no_parent_records_says_so_at_once_and_ends_at_the_timeout(
        log, tether, unserved):
    await an_open_run(log)
    told = Told()
    sending = asyncio.create_task(tether.parent(PARENT.agent, PARENT.name).send(
        "long", "wrap up", message_id="m1", timeout=5, expires_in=600, on_waiting=told))
    await asyncio.wait_for(told.event.wait(), 5)
    assert not sending.done()
    assert told.said[0].startswith("message 'm1' for run 'long' is stored and waits for at "
                                   f"most 600s (its expires_in); {unserved}"), told.said
    with pytest.raises(TimeoutError, match="then it is dropped"):
        await sending
    assert len(told.said) == 1, told.said


async def test_a_message_no_parent_records_is_refused_once_it_expired(log, tether):
    await an_open_run(log)
    said: list[str] = []
    with pytest.raises(MessageRefused) as refused:
        await tether.parent(PARENT.agent, PARENT.name).send(
            "long", "wrap up", message_id="m1", expires_in=0.5, timeout=DEADLINE_S,
            on_waiting=said.append)
    assert refused.value.code == "expired"
    assert str(refused.value) == ("message 'm1' for run 'long' expired: no parent service "
                                  "recorded it within 0.5s (its expires_in), so none will")
    assert len(said) == 1 and "no parent service answers" in said[0], said


async def test_a_message_recorded_for_another_run_on_this_runs_subject_is_no_receipt(log, tether):
    """A hostile or buggy publish puts another run's events, with the message's id, on
    this run's subject, which holds nothing of its own yet, while `send` waits: they are
    no receipt of it, and it waits for its own run (here: until the message expires, with
    no parent service)."""
    told = Told()
    sending = asyncio.create_task(tether.parent(PARENT.agent, PARENT.name).send(
        "long", "wrap up", message_id="m1", expires_in=2, timeout=DEADLINE_S,
        on_waiting=told))
    await asyncio.wait_for(told.event.wait(), 5)  # it waits: its feed is open
    other = RunEvents("other", PARENT)
    for event in (other.requested(), other.started(), other.running(),
                  other.make(RunMessageSent, message_id="m1", text="hi")):
        await log.publish(log.subjects.run_events(PARENT, "long"), encode_event(event),
                          headers={"Nats-Msg-Id": event.event_id},
                          stream=log.subjects.events_stream)
    with pytest.raises(MessageRefused) as refused:
        await sending
    assert refused.value.code == "expired"
