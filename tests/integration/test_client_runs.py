"""run_agent_tool against real JetStream, with a scripted stand-in for the parent service.

The stand-in reads the command stream and appends the events a test scripts for each
run request, so the client's waiting rules (mark, duplicates, rejections, cancellation)
are exercised over the real wire without the parent service.
"""

import asyncio
import contextlib
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Self

import pytest
from chat_readers import ACK_WAIT_S, held_while_the_other_waits
from eventually import eventually
from nats.aio.msg import Msg

from tether.adapters import chat_consumers
from tether.adapters.chat_consumers import TooManyReaders
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams
from tether.client import InputTooLarge, ServiceUnavailable, Tether, connect
from tether.client.awaiting import RunWaiter
from tether.client.feed import OrderedFeed
from tether.client.link import AwaitTiming
from tether.client.parent import ParentHandle, parent_handle
from tether.contract.messages import AgentToolFailure, AgentToolSuccess, ChatMessage, DetachedHandle
from tether.domain.commands import CancelCommand, RunCommand, parse_command
from tether.domain.events import Event, ParentRef, RunRejected
from tether.domain.ids import run_message_id
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")
Script = Callable[[RunEvents, RunCommand], list[Event]]


def completes(run: RunEvents, command: RunCommand) -> list[Event]:
    return [run.requested(command.agent_type, input=command.input), run.started(),
            run.running(), run.completed(f"done {command.input.get('n', '')}".strip())]


def hangs(run: RunEvents, command: RunCommand) -> list[Event]:
    return [run.requested(command.agent_type, input=command.input), run.started(), run.running()]


def rejects(run: RunEvents, command: RunCommand) -> list[Event]:
    return [run.make(RunRejected, agent_type=command.agent_type, code="unknown-agent",
                     error=f"unknown agent type {command.agent_type!r}")]


# How long a scripted parent that is told to stop may take to finish the command it is on.
HANDLING_GRACE_S = 5.0


class ScriptedParent:
    def __init__(self, log: EventLog, script: Script) -> None:
        self.log, self.script = log, script
        self.commands: list[object] = []
        self.received = asyncio.Condition()
        self._feed = OrderedFeed(log.nats, log.subjects.commands_stream,
                                 f"{log.subjects.prefix}.cmd.>")
        self._task: asyncio.Task | None = None
        # Held while one command is handled: its events appended, then the command recorded.
        self._handling = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self._feed.start()
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # A command being handled is finished first: a caller that already saw the run's
        # last event stored may leave before this parent has read that append's ack, and
        # the command must not go unrecorded then. (Bounded: a parent stuck on a broker
        # that is away is stopped anyway.)
        acquired = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HANDLING_GRACE_S):
                acquired = await self._handling.acquire()
        try:
            # Python 3.11's wait_for (inside nats-py requests) can swallow a cancellation
            # that lands as the request completes, so cancel until the task is really done.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=0.1)
        finally:
            if acquired:
                self._handling.release()
        await self._feed.stop()

    async def _serve(self) -> None:
        while True:
            message = await self._feed.sink.get()
            async with self._handling:
                await self._handle(message)

    async def _handle(self, message) -> None:
        command = parse_command(message.subject.split(".")[2], json.loads(message.data))
        if isinstance(command, RunCommand):
            run = RunEvents(command.run_id, command.parent, start_ms=int(time.time() * 1000),
                            id_prefix=f"{command.run_id}-{message.seq}")
            for event in self.script(run, command):
                await self.log.append(event, expected_last_seq=None)
        async with self.received:
            self.commands.append(command)
            self.received.notify_all()

    async def until(self, predicate, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout), self.received:
            await self.received.wait_for(lambda: predicate(self.commands))


@pytest.fixture
async def tether(log: EventLog, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


async def test_an_awaited_run_returns_the_summary_and_fan_out_shares_one_connection(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, completes):
        one = await me.run_agent_tool("Researcher", {"n": 0})
        many = await asyncio.gather(*(me.run_agent_tool("Researcher", {"n": n})
                                      for n in range(1, 6)))
    assert one.ok and one.summary == "done 0"
    assert [result.summary for result in many] == [f"done {n}" for n in range(1, 6)]
    assert len({result.run_id for result in [one, *many]}) == 6


async def test_a_repeated_run_id_returns_the_stored_outcome_without_a_second_turn(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, completes) as parent:
        first = await me.run_agent_tool("Researcher", {"n": 1}, run_id="same")
        again = await me.run_agent_tool("Researcher", {"n": 1}, run_id="same")
    assert again == first
    assert len(parent.commands) == 1, "the server dropped the repeat as a duplicate"
    assert [e.type for e in (await log.read_run(PARENT, "same")).events].count("run.running") == 1


async def test_a_rejection_is_a_non_retryable_failure_and_a_later_request_may_succeed(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, rejects):
        failure = await me.run_agent_tool("Nope", {}, run_id="rejected-1")
        handle = await me.run_agent_tool("Nope", {}, run_id="rejected-2", detached=True)
    assert isinstance(failure, AgentToolFailure)
    assert (failure.status, failure.retryable, failure.error) == (
        "error", False, "unknown agent type 'Nope'")
    assert handle == DetachedHandle(run_id="rejected-2", agent_type="Nope", status="error",
                                    error="unknown agent type 'Nope'")
    assert (await log.read_run(PARENT, "rejected-1")).state is None


async def test_a_duplicate_request_for_an_interrupted_run_returns_the_interruption(log, tether):
    run = RunEvents("stuck", PARENT)
    for event in [run.requested(), run.running(), run.interrupted("inspect-timeout", False)]:
        await log.append(event, expected_last_seq=None)
    # An earlier request with this run id is still in the server's duplicate window.
    await tether.publish_command("run", RunCommand(run_id="stuck", parent=PARENT,
                                                   agent_type="Researcher",
                                                   input={"query": "HTTP/3"}),
                                  run_message_id("stuck", parent=PARENT))
    result = await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
        "Researcher", {"query": "HTTP/3"}, run_id="stuck", timeout=10)
    assert (result.status, result.retryable, result.reason, result.child_still_running) == (
        "interrupted", True, "inspect-timeout", False)


async def test_a_detached_run_returns_a_handle_at_the_request(log, tether):
    async with ScriptedParent(log, hangs):
        handle = await tether.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {"n": 1}, run_id="bg-1", detached={"on_finish": "on_done"})
    assert handle == DetachedHandle(run_id="bg-1", agent_type="Researcher", status="running")


def fails(run: RunEvents, command: RunCommand) -> list[Event]:
    return [run.requested(command.agent_type, input=command.input), run.running(),
            run.failed("the source was down")]


@pytest.mark.parametrize(("script", "status", "result"), [
    (completes, "completed", AgentToolSuccess(run_id="bg-2", agent_type="Researcher",
                                              summary="done 2")),
    (fails, "error", AgentToolFailure(run_id="bg-2", agent_type="Researcher", status="error",
                                      error="the source was down", retryable=False)),
], ids=["completed", "failed"])
async def test_a_detached_run_requested_again_after_it_ended_answers_its_stored_outcome(
        log, tether, script, status, result):
    """Not `running`: the run has ended, and its finish hook (delivered once) will not come
    again, so a caller that waited for it would wait forever."""
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, script) as parent:
        await me.run_agent_tool("Researcher", {"n": 2}, run_id="bg-2", detached=True)
        await parent.until(lambda commands: len(commands) == 1)
        state = (await log.read_run(PARENT, "bg-2")).state
        assert state.status == status
        again = await me.run_agent_tool("Researcher", {"n": 2}, run_id="bg-2", detached=True)
    assert again == DetachedHandle(run_id="bg-2", agent_type="Researcher", status=status,
                                   result=result, error=getattr(result, "error", None))


async def test_cancelling_the_awaiting_task_cancels_the_run(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, hangs) as parent:
        awaiting = asyncio.create_task(me.run_agent_tool("Researcher", {}, run_id="abandoned"))
        await parent.until(lambda commands: any(isinstance(c, RunCommand) for c in commands))
        awaiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaiting
        await parent.until(lambda commands: any(isinstance(c, CancelCommand) for c in commands))
    [cancel] = [c for c in parent.commands if isinstance(c, CancelCommand)]
    assert (cancel.run_id, cancel.parent) == ("abandoned", PARENT)


async def test_a_timeout_stops_waiting_but_does_not_cancel(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, hangs) as parent:
        with pytest.raises(TimeoutError, match="it goes on"):
            await me.run_agent_tool("Researcher", {}, run_id="slow", timeout=0.3)
        await me.cancel("marker")  # commands are handled in order: this one comes last
        await parent.until(lambda commands: any(getattr(c, "run_id", None) == "marker"
                                                for c in commands))
    assert [c.run_id for c in parent.commands if isinstance(c, CancelCommand)] == ["marker"]


async def test_bad_arguments_are_refused_before_anything_is_sent(tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    with pytest.raises(ValueError, match="invalid run id"):
        await me.run_agent_tool("Researcher", {}, run_id="has space")
    with pytest.raises(ValueError, match="invalid agent type"):
        await me.run_agent_tool("Re.searcher", {})
    with pytest.raises(ValueError, match="on_finish"):
        await me.run_agent_tool("Researcher", {}, detached={"on_finish": "a b"})
    with pytest.raises(TypeError, match="JSON object"):
        await me.run_agent_tool("Researcher", ["not", "an", "object"])
    with pytest.raises(ValueError, match="invalid parent name"):
        tether.parent("Assistant", "user.1")


async def test_an_oversized_input_is_refused_before_anything_is_sent(log, tether, settings):
    me = tether.parent(PARENT.agent, PARENT.name)
    with pytest.raises(InputTooLarge) as refused:
        await me.run_agent_tool("Researcher", {"query": "x" * 300_000})
    assert str(refused.value) == ("the input is 300,012 bytes; the limit is 262,144 bytes "
                                  "(TETHER_MAX_INPUT_BYTES)")
    roomy = settings.model_copy(update={"max_input_bytes": 100_000_000})
    async with connect(settings=roomy) as client:
        limit = client.nc.max_payload
        with pytest.raises(InputTooLarge) as refused:
            await client.parent(PARENT.agent, PARENT.name).run_agent_tool(
                "Researcher", {"query": "x" * limit})
    assert str(refused.value).startswith("the run command is ")
    assert str(refused.value).endswith(
        f"bytes; the NATS server at {settings.nats_url} takes at most {limit:,} bytes per "
        "message (its max_payload)")
    info = await log.jetstream.stream_info(log.subjects.commands_stream)
    assert info.state.messages == 0


async def test_queries_without_a_parent_service_fail_clearly(tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    with pytest.raises(ServiceUnavailable, match=r"no parent service answers .*rpc.inspect"):
        await me.inspect("r1")
    with pytest.raises(ServiceUnavailable, match=r"rpc.has_run"):
        await me.has_run("r1")


async def test_chat_messages_are_replayed_and_shared_by_a_durable_reader(log, tether):
    messages = [ChatMessage(id=f"detached-finish:r{i}:completed", role="user",
                            content=f"run r{i} completed", metadata={"run_id": f"r{i}"})
                for i in range(3)]
    for message in messages:
        await log.jetstream.publish(log.subjects.chat(PARENT), message.model_dump_json().encode(),
                                    headers={"Nats-Msg-Id": message.id},
                                    stream=log.subjects.chat_stream)
    me = tether.parent(PARENT.agent, PARENT.name)

    async def first(count: int, **options) -> list[ChatMessage]:
        got: list[ChatMessage] = []
        async with asyncio.timeout(10), aclosing(me.chat(**options)) as chat:
            async for message in chat:
                got.append(message)
                if len(got) == count:
                    return got
        raise AssertionError("the chat ended early")

    assert await first(3) == messages
    assert await first(2, durable="app") == messages[:2]
    # A message is acknowledged when its reader asks for the next one: the second was
    # handed out but never acknowledged (it comes back after the ack wait), so the next
    # reader of the durable consumer gets the third.
    assert await first(1, durable="app") == messages[2:]


async def test_a_durable_readers_long_handling_keeps_its_message_from_the_other_reader(
        log, tether, monkeypatch):
    """A message a reader takes longer than the ack wait to handle is renewed while it is
    handled: the other reader of the name does not get it meanwhile."""
    monkeypatch.setattr(chat_consumers, "ACK_WAIT_S", ACK_WAIT_S)
    renewals = count_calls(monkeypatch, Msg, "in_progress")
    message = ChatMessage(id="detached-finish:r1:completed", role="user",
                          content="run r1 completed", metadata={"run_id": "r1"})
    await log.jetstream.publish(log.subjects.chat(PARENT), message.model_dump_json().encode(),
                                headers={"Nats-Msg-Id": message.id},
                                stream=log.subjects.chat_stream)
    me = tether.parent(PARENT.agent, PARENT.name)
    async with connect(settings=tether.settings) as other, \
            aclosing(me.chat(durable="app")) as handling, \
            aclosing(other.parent(PARENT.agent, PARENT.name).chat(durable="app")) as waiting:
        assert await held_while_the_other_waits(handling, waiting, renewals) == message
    consumer = await log.jetstream.consumer_info(log.subjects.chat_stream,
                                                 f"chat-{PARENT.agent}-{PARENT.name}-app")
    assert consumer.delivered.consumer_seq == 1, consumer  # handed out once


def count_calls(monkeypatch, owner: type, name: str) -> list[object]:
    """The calls of `owner.name` from now on (each call's first argument), still made."""
    calls: list[object] = []
    original = getattr(owner, name)

    async def counting(self, *args, **kwargs):
        calls.append(self)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


async def test_durable_chat_readers_of_one_parent_are_bounded_and_dropped(log, settings):
    """In Tether's own account the client makes the reader's consumer itself, under the
    same bounds the parent applies for applications in accounts of their own."""
    message = ChatMessage(id="m-1", role="assistant", content="hello", metadata={})
    await log.jetstream.publish(log.subjects.chat(PARENT), message.model_dump_json().encode(),
                                stream=log.subjects.chat_stream)
    bounded = settings.model_copy(update={"chat_readers_per_parent": 1,
                                          "chat_reader_inactive_ms": 60_000})
    async with connect(settings=bounded) as client:
        me = client.parent(PARENT.agent, PARENT.name)
        async with asyncio.timeout(10), aclosing(me.chat(durable="first")) as chat:
            assert (await anext(chat)).id == "m-1"
        with pytest.raises(TooManyReaders, match=r"TETHER_CHAT_READERS_PER_PARENT allows \(1\)"):
            async with aclosing(me.chat(durable="second")) as chat:
                await anext(chat)
        info = await log.jetstream.consumer_info(log.subjects.chat_stream,
                                                 f"chat-{PARENT.agent}-{PARENT.name}-first")
        assert info.config.inactive_threshold == 60
        assert await client.drop_chat_reader(PARENT, "first")
        assert not await client.drop_chat_reader(PARENT, "first")
        async with asyncio.timeout(10), aclosing(me.chat(durable="second")) as chat:
            assert (await anext(chat)).id == "m-1"


# --- following a run without a consumer: the live subject, the reads, and losses -------

def accepts(run: RunEvents, command: RunCommand) -> list[Event]:
    return [run.requested(command.agent_type, input=command.input), run.started()]


async def consumers_of_the_log(log: EventLog) -> int:
    return (await log.jetstream.stream_info(log.subjects.events_stream)).state.consumer_count


async def test_awaiting_and_fanning_out_create_no_consumer(log, tether):
    me = tether.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, hangs) as parent:
        awaiting = asyncio.create_task(me.run_agent_tool("Researcher", {}, run_id="open"))
        await parent.until(lambda commands: len(commands) == 1)
        assert await consumers_of_the_log(log) == 0
        awaiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaiting
    # Beyond the ~1,000 consumers nats-server allows on a stream (err 10026): one
    # consumer per request could not do this, and an ephemeral one outlives its
    # subscription by seconds, so any would still be counted below.
    async with ScriptedParent(log, accepts):
        handles = await asyncio.gather(*(me.run_agent_tool("Researcher", {"n": n},
                                                           detached=True)
                                         for n in range(1500)))
        assert await consumers_of_the_log(log) == 0
    assert {handle.status for handle in handles} == {"running"}
    assert len({handle.run_id for handle in handles}) == 1500


class RecordedReads:
    """The client's reads of the log (its `run_reads`), recorded: where each began, when,
    and what failed; with an optional action before the first one and after each."""

    def __init__(self, reads, before_first=None, after_each=None) -> None:
        self._reads, self._before_first, self._after_each = reads, before_first, after_each
        self.starts: list[int] = []
        self.times: list[float] = []  # when each read began (monotonic)
        self.failures: list[Exception] = []

    async def read(self, subject: str, start_seq: int = 1):
        if not self.starts and self._before_first is not None:
            await self._before_first()
        self.starts.append(start_seq)
        self.times.append(time.monotonic())
        try:
            stored = await self._reads.read(subject, start_seq)
        except Exception as error:
            self.failures.append(error)
            raise
        if self._after_each is not None:
            self._after_each()
        return stored


def recorded_reads(client: Tether, **options) -> RecordedReads:
    """The client's reads, from now on recorded (its `run_reads`, a seam of its `Link`)."""
    reads = client.run_reads = RecordedReads(client.run_reads, **options)
    return reads


class Seam:
    """The client's `Link` as a test changes it: the run's live messages of one event type
    lost (`lose`), as a slow consumer would lose them; the commands it publishes recorded
    (`published`, their message ids). Everything else is the client's own."""

    def __init__(self, client: Tether, *, lose: str | None = None) -> None:
        self._client, self._lose = client, lose
        self.published: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def handle(self) -> ParentHandle:
        return parent_handle(self, PARENT.agent, PARENT.name)

    async def subscribe_live(self, subject: str, route):
        if self._lose is None or subject.startswith(f"{self.subjects.prefix}.ctl.awaiter."):
            return await self._client.subscribe_live(subject, route)  # not a run's events
        assert subject.startswith(f"{self.subjects.prefix}.live."), subject

        def deliver(msg) -> None:
            if json.loads(msg.data)["type"] != self._lose:
                route(msg)

        return await self._client.subscribe_live(subject, deliver)

    async def publish_command(self, kind: str, command, msg_id: str, **options):
        self.published.append(msg_id)
        return await self._client.publish_command(kind, command, msg_id, **options)


async def watch_has_run(log: EventLog, tether: Tether):
    """The `has_run` queries that reach the parent's subject, and their subscription."""
    queries: list[bytes] = []

    async def seen(msg) -> None:
        queries.append(msg.data)

    return queries, await log.nats.subscribe(tether.subjects.rpc_for("has_run", PARENT),
                                             cb=seen)


def record_folds(monkeypatch) -> list[int]:
    folded: list[int] = []
    on_event = RunWaiter.on_event

    def recording(self, seq, event, pending=1):
        folded.append(seq)
        return on_event(self, seq, event, pending)

    monkeypatch.setattr(RunWaiter, "on_event", recording)
    return folded


@pytest.fixture(params=["direct", "scoped"])
async def reading(request, log: EventLog, settings) -> AsyncIterator[Tether]:
    """A client reading the log by batched direct gets, or as an application user does."""
    inbox_prefix = "_INBOX_app" if request.param == "scoped" else None
    async with connect(settings=settings, inbox_prefix=inbox_prefix) as client:
        yield client


async def test_a_new_run_id_is_requested_without_reading_the_run(log, reading, monkeypatch):
    reads = recorded_reads(reading)
    folded = record_folds(monkeypatch)
    me = reading.parent(PARENT.agent, PARENT.name)
    async with ScriptedParent(log, completes):
        result = await me.run_agent_tool("Researcher", {}, run_id="fresh", timeout=10)
        handle = await me.run_agent_tool("Researcher", {}, run_id="fresh-bg", detached=True,
                                         timeout=10)
    assert result.ok and handle.status == "running"
    assert reads.starts == [], "its first event, with nothing before it, placed the request"
    assert folded == [1, 2, 3, 4, 5]


async def test_events_both_read_and_received_live_are_folded_once(log, reading, monkeypatch):
    old = RunEvents("overlap", PARENT, id_prefix="old")
    subject = log.subjects.run_events(PARENT, "overlap")
    # An earlier request's rejection: the request's first event has it before it, so the
    # run is read then, while its next events arrive live as well.
    await log.append(old.make(RunRejected, agent_type="Researcher", code="cap",
                              error="too many agent tools"), expected_last_seq=None)
    reads = recorded_reads(reading)
    folded = record_folds(monkeypatch)
    async with ScriptedParent(log, completes):
        result = await reading.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {}, run_id="overlap", timeout=10)
    assert result.ok, "the earlier rejection, stored before the request, does not answer it"
    assert folded == [1, 2, 3, 4, 5] == [m.seq for m in await log.read_subject(subject)]
    assert reads.starts == [1]


async def test_a_lost_live_event_is_read_when_the_next_one_reveals_it(log, reading,
                                                                      monkeypatch):
    reading.awaiting = AwaitTiming(live_idle_s=60.0)  # only the gap can tell
    reads = recorded_reads(reading)
    folded = record_folds(monkeypatch)
    async with ScriptedParent(log, completes):
        result = await Seam(reading, lose="run.running").handle().run_agent_tool(
            "Researcher", {}, run_id="gap", timeout=10)
    assert result.ok and result.summary == "done"
    assert reads.starts == [3], "read from the lost run.running on (a new run is not read first)"
    assert folded == [1, 2, 3, 4]


async def test_a_lost_last_event_is_found_by_reading_again_when_nothing_comes(
        log, reading):
    reading.awaiting = AwaitTiming(live_idle_s=0.1)
    reads = recorded_reads(reading)
    async with ScriptedParent(log, completes):
        result = await Seam(reading, lose="run.completed").handle().run_agent_tool(
            "Researcher", {}, run_id="quiet", timeout=10)
    assert result.ok and result.summary == "done"
    assert reads.starts and set(reads.starts) == {4}, "read after what came live, only"


async def test_a_quiet_run_is_read_again_less_and_less_often(log, reading):
    reading.awaiting = AwaitTiming(live_idle_s=0.05, live_idle_max_s=0.2)
    reads = recorded_reads(reading)
    # No parent answers: the request stays unanswered until the timeout.
    with pytest.raises(TimeoutError, match="gave no answer within 2s"):
        await reading.parent(PARENT.agent, PARENT.name).run_agent_tool(
            "Researcher", {}, run_id="quiet-long", timeout=2)
    # Each quiet read doubles the wait, up to the maximum: 0.05, 0.1, 0.2, 0.2, ... after
    # the first (a busy machine only stretches the gaps): about 11 reads, not a fixed 50 ms's 40.
    gaps = [later - earlier for earlier, later in itertools.pairwise(reads.times)]
    assert 4 <= len(reads.times) <= 12, gaps
    assert all(gap >= wait - 0.005 for gap, wait in zip(gaps, [0.05, 0.1] + [0.2] * 10, strict=False)), gaps


async def test_a_request_its_parent_is_slow_to_handle_costs_the_parent_no_query(
        log, reading, monkeypatch):
    reading.awaiting = AwaitTiming(live_idle_s=0.05)
    quiet_twice = asyncio.Event()
    reads = recorded_reads(
        reading, after_each=lambda: len(reads.starts) >= 2 and quiet_twice.set())
    seam = Seam(reading)
    queries, asked = await watch_has_run(log, reading)
    folded = record_folds(monkeypatch)
    me = seam.handle()
    waiting = asyncio.create_task(me.run_agent_tool("Researcher", {}, run_id="slow-parent",
                                                    timeout=10))
    # No parent yet: each quiet second reads the run, finds nothing and repeats the request.
    await asyncio.wait_for(quiet_twice.wait(), 5)
    async with ScriptedParent(log, completes) as parent:
        result = await waiting
    await asyncio.wait_for(log.nats.flush(), 5)
    await asked.unsubscribe()
    assert result.ok and result.summary == "done"
    published = seam.published
    assert len(published) >= 2 and len(set(published)) == 1, "repeats under the request's id"
    assert queries == [], "a repeat of its own stored request is not the parent's question"
    assert len(parent.commands) == 1, "the stream dropped the repeats"
    assert set(reads.starts) == {1} and folded == [1, 2, 3, 4]


async def test_a_request_whose_first_live_event_was_lost_is_read_without_a_query(
        log, reading):
    reading.awaiting = AwaitTiming(live_idle_s=0.05)
    queries, asked = await watch_has_run(log, reading)

    def requested_only(run: RunEvents, command: RunCommand) -> list[Event]:
        return [run.requested(command.agent_type, input=command.input)]

    async with ScriptedParent(log, requested_only) as parent:
        handle = await Seam(reading, lose="run.requested").handle().run_agent_tool(
            "Researcher", {}, run_id="first-lost", detached=True, timeout=10)
    await asyncio.wait_for(log.nats.flush(), 5)
    await asked.unsubscribe()
    assert handle.status == "running", "read when nothing came, and published again"
    assert queries == [], "the repeat named the request's own sequence"
    assert len(parent.commands) == 1


async def test_a_request_the_broker_lost_is_sent_again_and_answered(devstack, settings,
                                                                    tmp_path):
    """A broker of its own loses its store while a request waits for its parent (killed,
    its disk gone, started again empty): the quiet looks that fail while it is away do
    not end the wait, and the next one finds no run and publishes the request again."""
    port, store = devstack.free_port(), tmp_path / "store"

    def start():
        return devstack.start_nats(store, port, tmp_path / "nats.log", daemon=False)

    server = start()
    own = settings.model_copy(update={"nats_url": f"nats://127.0.0.1:{port}"})
    back = asyncio.Event()

    async def reconnected() -> None:
        back.set()

    nc = await connect_nats(own.nats_connect_url, name="scripted-parent",
                            reconnected_cb=reconnected)
    log = EventLog(nc, own.subjects)
    await ensure_streams(log.jetstream, own.subjects, StreamSettings())
    try:
        async with connect(settings=own) as client:
            client.awaiting = AwaitTiming(live_idle_s=0.05, live_idle_max_s=0.2)
            reads = recorded_reads(client)
            waiting = asyncio.create_task(client.parent(PARENT.agent, PARENT.name).run_agent_tool(
                "Researcher", {}, run_id="lost", timeout=90))
            await eventually(lambda: len(reads.starts) >= 1, timeout=10)
            server.kill()
            server.wait(timeout=10)
            shutil.rmtree(store)
            # A look on the broker that is away fails (when its request times out).
            await eventually(lambda: reads.failures, timeout=30)
            assert not waiting.done(), "a look that failed while the broker was away ends nothing"
            server = start()
            await asyncio.wait_for(back.wait(), 10)
            await ensure_streams(log.jetstream, own.subjects, StreamSettings())
            async with ScriptedParent(log, completes) as parent:
                result = await asyncio.wait_for(waiting, 30)
        assert result.ok and result.summary == "done"
        assert len(parent.commands) == 1, "the request, published again into the empty stream"
    finally:
        await nc.close()
        server.kill()
        server.wait(timeout=10)


async def test_streams_made_before_the_live_subject_get_it_on_start_up(log, nc, settings):
    js, subjects = nc.jetstream(), settings.subjects
    config = (await js.stream_info(subjects.events_stream)).config
    config.republish = None
    await js.update_stream(config)
    assert (await js.stream_info(subjects.events_stream)).config.republish is None
    await ensure_streams(js, subjects, StreamSettings())
    republish = (await js.stream_info(subjects.events_stream)).config.republish
    assert (republish.src, republish.dest) == (subjects.all_events, subjects.all_live_events)
