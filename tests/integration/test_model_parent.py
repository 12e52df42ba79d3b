"""A model parent: an AgentDefinition whose tools include child agents, against real NATS.

The parent service and a child-runner run in-process; the runner's parent client is a
Tether client, so the model parent's agent-tool calls become runs on its own timeline
(`<agent type>/<run id>`). Each test gives the model a fresh scripted client; every wait
follows events or polls a condition with a deadline.
"""

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import pytest
from eventually import eventually
from pydantic import BaseModel, Field
from ui_tree_agents import Paper, sign  # the tree the UI test's services load too

from tether import ChildAgent, RunContext, agent_tool
from tether.adapters.postgres.projector import Projector
from tether.agent_registry import AgentRegistry
from tether.agents import (
    AgentDefinition,
    ModelAgent,
    ModelAgentInput,
    ModelParent,
    ModelPrice,
    PriceTable,
    Reply,
    ScriptedModelClient,
    ToolContext,
    tool,
)
from tether.agents.devtools import render_run, show_run
from tether.child.execution import Execution
from tether.client import Tether, connect
from tether.client.conversation import ConversationEnded
from tether.contract.messages import ChatMessage, UsageView
from tether.domain import decide
from tether.domain.events import ParentRef
from tether.domain.ids import chat_finish_id, nested_parent_name, user_message_id
from tether.log import get_logger
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent

DEADLINE_S = 10


def decide_now() -> int:
    return int(time.time() * 1000)


class Query(BaseModel):
    query: str = Field(min_length=3)
    siblings: int = 1  # how many Researchers the same turn starts


class Researcher(ChildAgent):
    """Researches one topic; `bad` fails. It waits (bounded) until as many Researchers as
    the turn started run at once, so a sequential fan-out fails the test."""

    input_model = Query
    active: ClassVar[set[str]] = set()
    together: ClassVar[asyncio.Event | None] = None

    async def run(self, ctx: RunContext, input: Query) -> str:
        if input.query == "bad":
            raise RuntimeError("no sources found for 'bad'")
        await ctx.report_progress(fraction=1.0, phase="reading")
        cls = type(self)
        cls.active.add(input.query)
        if len(cls.active) >= input.siblings and cls.together is not None:
            cls.together.set()
        try:
            if input.siblings > 1:
                assert cls.together is not None
                await asyncio.wait_for(cls.together.wait(), timeout=5)
        finally:
            cls.active.discard(input.query)
        return f"findings on {input.query}"


class Note(BaseModel):
    text: str


@tool
async def remember(ctx: ToolContext, input: Note) -> str:
    """Write a note down."""
    return f"noted: {input.text}"


class Text(BaseModel):
    text: str


class Summarizer(ModelAgent):
    """A model child whose first message is worded from its input and the request."""

    definition = AgentDefinition(id="summarizer", model="scripted")
    input_model = Text
    script = ()

    def format_agent_tool_input(self, input: Text, request) -> str:
        return (f"Summarize for {request.parent.agent}/{request.parent.name} "
                f"({request.run_id}, call {request.parent_tool_call_id}):\n\n{input.text}")


class Planner(ModelAgent):
    definition = AgentDefinition(
        id="planner", model="scripted", max_steps=4,
        instructions="Plan; delegate research to the Researcher tool.",
        tools=(agent_tool(Researcher, description="Research one topic in depth.",
                          display_name="Research"), remember,
               agent_tool(Summarizer, description="Summarize a text.")))
    script = ()


AGENTS = (Researcher, Summarizer, Planner)


@pytest.fixture(autouse=True)
def fresh_researchers():
    Researcher.active = set()
    Researcher.together = asyncio.Event()
    Assistant.progress = []


@pytest.fixture
async def tether(log, settings) -> AsyncIterator[Tether]:
    async with connect(settings=settings) as client:
        yield client


class Runners:
    """Child-runners started and stopped by a test; a stopped one gives its work back
    (SIGTERM's path: its children get `shutdown_grace_s`, then their items go back)."""

    def __init__(self, settings, tether: Tether) -> None:
        self._settings, self._tether = settings, tether
        self._running: list[tuple[asyncio.Event, asyncio.Task]] = []

    async def start(self) -> tuple[asyncio.Event, asyncio.Task]:
        tether = self._tether
        runner = await open_runner(tether.nc, self._settings.model_copy(update={"work_ack_wait_ms": 1500}),
                             AgentRegistry(AGENTS), fetch_timeout_s=0.3, cancel_grace_s=0.2,
                             shutdown_grace_s=0.5,
                             parent_client=lambda ref: tether.parent(ref.agent, ref.name))
        stop = asyncio.Event()
        handle = (stop, asyncio.create_task(runner.run(stop)))
        self._running.append(handle)
        return handle

    async def stop(self, handle: tuple[asyncio.Event, asyncio.Task]) -> None:
        stop, task = handle
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        self._running.remove(handle)

    async def stop_all(self) -> None:
        for handle in list(self._running):
            await self.stop(handle)


@pytest.fixture
async def runners(settings, log, pool, tether) -> AsyncIterator[Runners]:
    """The parent service, and child-runners the test starts."""
    parent = await open_parent(settings, log, pool, AgentRegistry(AGENTS),
                           get_logger(service="parent-test"))
    stop = asyncio.Event()
    task = asyncio.create_task(parent.run(stop))
    started = Runners(settings, tether)
    yield started
    await started.stop_all()
    stop.set()
    await asyncio.wait_for(task, timeout=10)


@pytest.fixture
async def services(runners):
    await runners.start()
    return runners


@pytest.fixture
def scripted(monkeypatch) -> Callable[..., ScriptedModelClient]:
    def give(agent: type[ModelAgent], script: list) -> ScriptedModelClient:
        client = ScriptedModelClient(script)
        monkeypatch.setattr(agent, "model_client", client)
        return client
    return give


def below(owner: tuple[str, str], agent_type: str, run_id: str) -> tuple[str, str]:
    """The parent that run `run_id` (of `agent_type`) of `owner` is to the runs it starts."""
    return agent_type, nested_parent_name(*owner, run_id)


async def runs_of(tether: Tether, agent: str, name: str) -> dict:
    """The runs on a parent's timeline, as the log has them now."""
    view = None
    async for view in tether.parent(agent, name).timeline(live=False):  # noqa: B007 - the last view
        pass
    return dict(view.runs) if view is not None else {}


def tool_messages(client: ScriptedModelClient, turn: int) -> dict[str, str]:
    """The tool results the model was shown at `turn`, by tool call id."""
    return {m.tool_call_id: m.content for m in client.requests[turn].messages
            if m.role == "tool"}


async def test_parallel_agent_tool_calls_fan_out_as_runs_of_the_model_parents_timeline(
        services, tether, scripted):
    client = scripted(Planner, [
        Reply("Researching both.", [("Researcher", {"query": "HTTP/3", "siblings": 2}),
                                    ("Researcher", {"query": "gRPC", "siblings": 2}),
                                    ("remember", {"text": "compare transports"})]),
        Reply("HTTP/3 and gRPC compared.")])
    me = tether.parent("Assistant", "fan-out")
    result = await asyncio.wait_for(
        me.run_agent_tool("Planner", {"input": "Compare HTTP/3 and gRPC"}, run_id="plan-1"),
        DEADLINE_S)

    assert result.ok, result
    assert result.summary == "HTTP/3 and gRPC compared."
    # Both Researchers ran at once (each waited for the other) and answered the model.
    assert tool_messages(client, 1) == {"call_0_0": "findings on HTTP/3",
                                        "call_0_1": "findings on gRPC",
                                        "call_0_2": "noted: compare transports"}
    # Their runs belong to the model parent's run, keyed by the tool call.
    runs = await runs_of(tether, *below((me.agent, me.name), "Planner", "plan-1"))
    assert set(runs) == {"agent-tool:call_0_0", "agent-tool:call_0_1"}
    assert {run.parent_tool_call_id for run in runs.values()} == {"call_0_0", "call_0_1"}
    assert all(run.status == "completed" for run in runs.values())
    # One model turn per reply: the turn was recorded before its runs started.
    assert len(client.requests) == 2


async def test_a_failed_child_comes_back_as_failure_json_and_the_model_reissues_it(
        services, tether, scripted):
    client = scripted(Planner, [
        Reply("", [("Researcher", {"query": "bad"})]),
        Reply("Trying a better query.", [("Researcher", {"query": "good topic"})]),
        Reply("Found it.")])
    me = tether.parent("Assistant", "retry")
    result = await asyncio.wait_for(
        me.run_agent_tool("Planner", {"input": "Research"}, run_id="plan-2"), DEADLINE_S)

    assert result.ok and result.summary == "Found it."
    failure = json.loads(tool_messages(client, 1)["call_0_0"])
    assert {key: failure[key] for key in ("ok", "status", "retryable", "run_id")} == {
        "ok": False, "status": "error", "retryable": False, "run_id": "agent-tool:call_0_0"}
    assert "no sources found" in failure["error"]
    assert tool_messages(client, 2)["call_1_0"] == "findings on good topic"
    statuses = {run_id: run.status
                for run_id, run in (await runs_of(tether, *below((me.agent, me.name), "Planner", "plan-2"))).items()}
    assert statuses == {"agent-tool:call_0_0": "error", "agent-tool:call_1_0": "completed"}


async def test_invalid_arguments_are_a_failure_for_the_model_and_start_no_run(
        services, tether, scripted):
    client = scripted(Planner, [Reply("", [("Researcher", {"query": "x"})]), Reply("Sorry.")])
    me = tether.parent("Assistant", "invalid")
    result = await asyncio.wait_for(
        me.run_agent_tool("Planner", {"input": "Research"}, run_id="plan-3"), DEADLINE_S)

    assert result.ok
    assert "invalid input" in tool_messages(client, 1)["call_0_0"]
    assert await runs_of(tether, *below((me.agent, me.name), "Planner", "plan-3")) == {}


async def test_a_model_childs_first_message_is_shaped_by_format_agent_tool_input(
        services, tether, scripted):
    scripted(Planner, [Reply("", [("Summarizer", {"text": "QUIC is UDP-based."})]),
                       Reply("Summarized.")])
    child = scripted(Summarizer, [Reply("QUIC runs over UDP.")])
    me = tether.parent("Assistant", "shaped")
    result = await asyncio.wait_for(
        me.run_agent_tool("Planner", {"input": "Summarize"}, run_id="plan-4"), DEADLINE_S)

    assert result.ok and result.summary == "Summarized."
    assert [m.content for m in child.requests[0].messages] == [
        (f"Summarize for Planner/{nested_parent_name('Assistant', 'shaped', 'plan-4')} "
         "(agent-tool:call_0_0, call call_0_0):\n\nQUIC is UDP-based.")]


# --- durable conversations ------------------------------------------------------------


class ImportJob(BaseModel):
    rows: int = 2


class Importer(ChildAgent):
    """Imports rows in the background; passes `rows-loaded` and `needs-review`."""

    input_model = ImportJob

    async def run(self, ctx: RunContext, input: ImportJob) -> str:
        await ctx.report_progress(fraction=1.0, phase="loading", message="all rows read")
        await ctx.report_progress(milestone="rows-loaded", data={"rows": input.rows})
        await ctx.report_progress(milestone="needs-review")
        await ctx.report_progress(milestone="noisy")
        return f"imported {input.rows} rows"


def last_user(request) -> str:
    return next(m.content for m in reversed(request.messages) if m.role == "user")


def answer(request) -> Reply:
    """The model says what it was told last."""
    return Reply(f"seen: {last_user(request)}")


class Assistant(ModelParent):
    definition = AgentDefinition(
        id="assistant", model="scripted", max_steps=4, instructions="Help the user.",
        tools=(agent_tool(Researcher, description="Research one topic in depth."),
               agent_tool(Importer, description="Import rows in the background.",
                          detached={"notify": True,
                                    "on_milestones": {"names": ["rows-loaded"],
                                                      "mode": "narrate"}}),
               agent_tool(Importer, name="ImportHooked",
                          description="Import rows; a hook of the application hears the end.",
                          detached={"notify": True, "on_finish": "on_import_done"}),
               agent_tool(Importer, name="ImportReviewed",
                          description="Import rows; the model reviews them.",
                          detached={"notify": True,
                                    "on_milestones": {"names": ["needs-review", "noisy"],
                                                      "mode": "react"}})))
    script = ()
    progress: ClassVar[list] = []

    async def on_progress(self, run, progress) -> None:
        type(self).progress.append((run.run_id, run.agent_type, progress.phase,
                                    progress.milestone))

    def format_detached_completion(self, run, result) -> str:
        return f"The {run.agent_type} finished: {result.summary}"

    def format_detached_milestone(self, run, milestone) -> str:
        if milestone.name == "noisy":
            return ""  # suppressed: no message, no model turn
        return f"{run.agent_type} reached {milestone.name}"


AGENTS = (*AGENTS, Importer, Assistant)


async def until_chat(conversation, count: int, predicate=lambda m: True) -> list:
    """The conversation's first `count` messages that match."""
    found = []
    async with asyncio.timeout(DEADLINE_S):
        async for message in conversation.messages():
            if predicate(message):
                found.append(message)
                if len(found) == count:
                    return found
    raise AssertionError("unreachable")


def from_model(message) -> bool:
    return message.metadata.get("source") == "model"


async def test_a_conversation_answers_each_message_with_its_history_in_the_log(
        services, tether, scripted, log):
    client = scripted(Assistant, [answer, answer])
    conversation = tether.conversation("Assistant", "chat-1", owner=("User", "u1"))
    await conversation.start()
    chat = await conversation.chat()
    assert await asyncio.wait_for(conversation.ask("hello", message_id="m1"), DEADLINE_S) \
        == "seen: hello"
    # A message sent twice is one message: one model turn for it.
    await conversation.send("hello", message_id="m1")
    assert await asyncio.wait_for(conversation.ask("and now?", message_id="m2"), DEADLINE_S) \
        == "seen: and now?"

    assert [[m.content for m in r.messages] for r in client.requests] == [
        ["hello"], ["hello", "seen: hello", "and now?"]]
    history = await log.read_run(conversation.owner.ref, "chat-1")
    steps = [history.state.steps[i] for i in sorted(history.state.steps)]
    assert [(s["kind"], s["inbox"], s["status"]) for s in steps] == [
        ("continuation", [user_message_id(chat, "m1")], "running"),
        ("model_turn", [], "completed"),
        ("continuation", [user_message_id(chat, "m2")], "running"),
        ("model_turn", [], "completed")]
    assert history.state.status == "running"
    shown = render_run(history.state)
    assert history.state.agent_version is not None
    assert f"attempt 1  version {history.state.agent_version}\n" in shown
    assert f"      human hello\n      took  {user_message_id(chat, 'm1')}" in shown
    assert "text  seen: and now?" in shown
    await conversation.close()
    async def aborted() -> bool:
        return (await log.read_run(conversation.owner.ref, "chat-1")).state.status == "aborted"

    await eventually(aborted, timeout=DEADLINE_S, interval=0.02)


async def test_asking_a_conversation_that_is_not_open_says_so_at_once(
        services, tether, scripted, log):
    """Not started, failed (the model could not answer) or closed: `ask` raises
    `ConversationEnded` with the run's status instead of waiting for an answer that will
    never come; a closed conversation started again says it is closed."""
    conversation = tether.conversation("Assistant", "chat-ended", owner=("User", "u1"))
    with pytest.raises(ConversationEnded, match="is not started") as ended:
        await asyncio.wait_for(conversation.ask("anyone?", message_id="early"), DEADLINE_S)
    assert ended.value.status is None

    scripted(Assistant, [])  # the model has no answer for the first turn: the run fails
    await conversation.start()
    with pytest.raises(ConversationEnded, match="ended error") as ended:
        await asyncio.wait_for(conversation.ask("hello", message_id="m1"), DEADLINE_S)
    assert (ended.value.status, ended.value.error) == (
        "error", (await conversation.inspect()).error)

    closing = tether.conversation("Assistant", "chat-closed", owner=("User", "u1"))
    scripted(Assistant, [answer])
    await closing.start()
    assert await asyncio.wait_for(closing.ask("hello", message_id="m1"), DEADLINE_S) \
        == "seen: hello"
    await closing.close()
    with pytest.raises(ConversationEnded, match="was closed or cancelled") as ended:
        await asyncio.wait_for(closing.ask("still there?", message_id="m2"), DEADLINE_S)
    assert ended.value.status == "aborted"
    # Its earlier answer is still its answer, and starting it again says it is closed.
    assert (await asyncio.wait_for(closing.reply(await closing.send("hello", message_id="m1")),
                                   DEADLINE_S)).content == "seen: hello"
    handle = await closing.start()
    assert (handle.status, handle.result.status) == ("aborted", "aborted")


async def test_a_cleared_conversation_starts_again_with_nothing_of_its_last_life(
        services, tether, scripted, log):
    client = scripted(Assistant, [answer, answer])
    conversation = tether.conversation("Assistant", "chat-again", owner=("User", "u1"))
    await conversation.start()
    assert await asyncio.wait_for(conversation.ask("first life", message_id="m1"),
                                  DEADLINE_S) == "seen: first life"
    await conversation.close()
    await conversation.send("left behind", message_id="m2")  # queued on the closed one
    await conversation.owner.clear()

    async def cleared():
        return (await log.read_run(conversation.owner.ref, "chat-again")).state is None

    await eventually(cleared, timeout=DEADLINE_S, interval=0.02)
    handle = await conversation.start()
    assert handle.status == "running"
    assert await asyncio.wait_for(conversation.ask("second life", message_id="m3"),
                                  DEADLINE_S) == "seen: second life"
    assert [m.content for m in client.requests[-1].messages] == ["second life"]
    await conversation.close()


async def test_notify_and_milestones_reach_the_model_once_narrate_without_a_turn(
        services, tether, scripted):
    client = scripted(Assistant, [
        Reply("", [("Importer", {"rows": 5})]), Reply("Import started."), answer, answer])
    conversation = tether.conversation("Assistant", "chat-2", owner=("User", "u1"))
    await conversation.start()
    await conversation.send("import five rows", message_id="go")
    replies = await until_chat(conversation, 2, from_model)

    assert [m.content for m in replies] == [
        "Import started.", "seen: The Importer finished: imported 5 rows"]
    started = json.loads(tool_messages(client, 1)["call_0_0"])
    assert (started["run_id"], started["status"]) == ("agent-tool:call_0_0", "running")
    messages = await until_chat(conversation, 5)
    narrated = [m for m in messages if m.metadata.get("kind") == "milestone"]
    assert [(m.role, m.content, m.metadata["mode"]) for m in narrated] == [
        ("assistant", "Importer reached rows-loaded", "narrate")]
    # Two model calls for the user's message, one for the completion; the narrated line
    # is in the model's context as an assistant message, with no turn of its own.
    assert len(client.requests) == 3
    assert [m.content for m in client.requests[2].messages if m.role == "assistant"] == [
        "", "Import started.", "Importer reached rows-loaded"]


async def test_two_users_conversations_of_one_name_and_tool_call_ids_are_each_their_own(
        services, tether, scripted, log):
    """Two users each hold the conversation `support` and send the message `go`; the
    model answers both with the tool call `call_0_0` (a detached Importer): each user's
    conversation is its own run, its call its own run and child turn under it, and each
    conversation is told of its own run's outcome once."""
    client = scripted(Assistant, [Reply("", [("Importer", {"rows": 5})]),
                                  Reply("Import started."), answer, answer])
    owners = [ParentRef(agent="User", name=user) for user in ("u1", "u2")]
    conversations = [tether.conversation("Assistant", "support", owner=owner)
                     for owner in owners]
    for conversation in conversations:  # one after the other (the script is by turn)
        await conversation.start()
        await conversation.send("import five rows", message_id="go")
        replies = await until_chat(conversation, 2, from_model)
        assert [m.content for m in replies] == [
            "Import started.", "seen: The Importer finished: imported 5 rows"]

    trees = [conversation.parent.ref for conversation in conversations]
    assert trees[0] != trees[1]
    for owner, tree, conversation in zip(owners, trees, conversations, strict=True):
        assert (await log.read_run(owner, "support")).state.as_parent() == tree
        state = (await log.read_run(tree, "agent-tool:call_0_0")).state
        assert (state.status, state.summary, state.attempt) == (
            "completed", "imported 5 rows", 1)
        notices = [m for m in await until_chat(conversation, 5)
                   if m.metadata.get("kind") == "finish"]
        assert [m.id for m in notices] == [chat_finish_id(state, "completed")]
        await conversation.close()
    # Three model calls each: the message's two, and one for its own run's outcome.
    assert len(client.requests) == 6


async def test_react_milestones_take_a_turn_and_an_empty_format_suppresses_one(
        services, tether, scripted):
    client = scripted(Assistant, [
        Reply("", [("ImportReviewed", {"rows": 1})]), Reply("Started."), answer, answer])
    conversation = tether.conversation("Assistant", "chat-3", owner=("User", "u1"))
    await conversation.start()
    await conversation.send("import and review", message_id="go")
    replies = await until_chat(conversation, 3, from_model)

    assert [m.content for m in replies] == [
        "Started.", "seen: Importer reached needs-review",
        "seen: The Importer finished: imported 1 rows"]
    assert len(client.requests) == 4
    # `noisy` was formatted to "": no message, so no turn.
    texts = [m.content for r in client.requests for m in r.messages]
    assert not any("noisy" in text for text in texts)


async def test_on_progress_sees_the_live_progress_and_milestones_of_the_conversations_runs(
        services, tether, scripted):
    scripted(Assistant, [Reply("", [("Importer", {"rows": 3}), ("Researcher", {"query": "QUIC"})]),
                         Reply("Started."), answer, answer])
    conversation = tether.conversation("Assistant", "chat-4", owner=("User", "u1"))
    await conversation.start()
    await conversation.send("import three rows", message_id="go")
    await until_chat(conversation, 2, from_model)

    expected = [("agent-tool:call_0_1", "Researcher", "reading", None),  # awaited
                ("agent-tool:call_0_0", "Importer", "loading", None),  # detached
                ("agent-tool:call_0_0", "Importer", None, "rows-loaded"),
                ("agent-tool:call_0_0", "Importer", None, "needs-review")]
    await eventually(lambda: all(item in Assistant.progress for item in expected),
                     timeout=DEADLINE_S, interval=0.02)
    milestones = [m for *_, m in Assistant.progress if m]
    assert milestones == ["rows-loaded", "needs-review", "noisy"], "each once, in order"


async def test_an_on_finish_hook_replaces_notify_for_a_detached_agent_tool(
        services, tether, scripted, log):
    client = scripted(Assistant, [Reply("", [("ImportHooked", {"rows": 4})]),
                                  Reply("Import started."), answer])
    finished: asyncio.Queue = asyncio.Queue()
    hooks = tether.hooks("Assistant")

    @hooks.on_finish("on_import_done")
    async def on_import_done(run, result) -> None:
        await finished.put((run, result))

    conversation = tether.conversation("Assistant", "chat-hook", owner=("User", "u1"))
    async with hooks.running():
        await conversation.start()
        assert await asyncio.wait_for(conversation.ask("import four rows", message_id="go"),
                                      DEADLINE_S) == "Import started."
        run, result = await asyncio.wait_for(finished.get(), DEADLINE_S)
        assert (run.run_id, run.parent, result.status, result.summary) == (
            "agent-tool:call_0_0", conversation.parent.ref, "completed", "imported 4 rows")

        async def delivered():
            state = (await log.read_run(conversation.parent.ref, "agent-tool:call_0_0")).state
            return state if state.ledger.finish else None

        state = await eventually(delivered, timeout=DEADLINE_S, interval=0.02)
    assert list(state.ledger.finish) == ["on_import_done:completed"]
    assert state.ledger.notifications == {}, "no completion message in the conversation"
    # The model's next turn is for the next message; the outcome never reached it.
    assert await asyncio.wait_for(conversation.ask("and now?", message_id="next"),
                                  DEADLINE_S) == "seen: and now?"
    assert len(client.requests) == 3
    assert not any("imported" in m.content for m in client.requests[2].messages)
    kinds = [m.metadata.get("kind") for m in await until_chat(conversation, 4)]
    assert kinds == ["message", "reply", "message", "reply"]
    await conversation.close()


async def test_after_a_takeover_on_progress_is_not_fired_again_and_inspect_has_the_progress(
        runners, tether, scripted):
    scripted(Assistant, [Reply("", [("Researcher", {"query": "QUIC"})]), Reply("Researched."),
                         answer])
    first = await runners.start()
    conversation = tether.conversation("Assistant", "chat-progress", owner=("User", "u1"))
    await conversation.start()
    assert await asyncio.wait_for(conversation.ask("research QUIC", message_id="go"),
                                  DEADLINE_S) == "Researched."
    seen = ("agent-tool:call_0_0", "Researcher", "reading", None)
    await eventually(lambda: seen in Assistant.progress, timeout=DEADLINE_S, interval=0.02)
    before = list(Assistant.progress)

    await runners.stop(first)
    await runners.start()
    # The new runner holds the conversation once it has answered the next message.
    assert await asyncio.wait_for(conversation.ask("and now?", message_id="next"),
                                  DEADLINE_S) == "seen: and now?"
    assert Assistant.progress == before, "old signals are not replayed to on_progress"
    snapshot = await conversation.parent.inspect("agent-tool:call_0_0")
    assert (snapshot.status, snapshot.progress["phase"], snapshot.progress["fraction"]) == (
        "completed", "reading", 1.0)
    await conversation.close()


# --- the tree -------------------------------------------------------------------------

PRICES = PriceTable.of({"tree-model": ModelPrice(input_per_million=1.0, output_per_million=2.0)})


class Clerk(ModelAgent):
    definition = AgentDefinition(id="clerk", model="tree-model", tools=(sign,), prices=PRICES)
    script = (Reply("Signing.", [("sign", {"title": "lease"})]), Reply("Signed the lease."))


class Lead(ModelAgent):
    definition = AgentDefinition(
        id="lead", model="tree-model", prices=PRICES,
        tools=(agent_tool(Clerk, description="Get papers signed.",
                          input_model=ModelAgentInput),))
    script = (Reply("", [("Clerk", {"input": "sign the lease"})]), Reply("The clerk signed."))


class Chief(ModelAgent):
    definition = AgentDefinition(
        id="chief", model="tree-model", prices=PRICES,
        tools=(agent_tool(Lead, description="Delegate to the lead.",
                          input_model=ModelAgentInput),))
    script = (Reply("", [("Lead", {"input": "handle the lease"})]), Reply("All done."))


AGENTS = (*AGENTS, Clerk, Lead, Chief)


def tree_runs(root: str) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """The Lead's and the Clerk's runs (parent agent, parent name, run id) under the
    Chief's run `tree-run` of `Assistant/<root>`."""
    lead = (*below(("Assistant", root), "Chief", "tree-run"), "agent-tool:call_0_0")
    clerk = (*below(lead[:2], "Lead", lead[2]), "agent-tool:call_0_0")
    return lead, clerk


async def waiting_view(root) -> Any:
    """The root's run once its timeline shows the grandchild's pause."""
    async with asyncio.timeout(DEADLINE_S):
        async for view in root.timeline():
            run = view.runs.get("tree-run")
            if run is not None and run.waiting_for == "waiting_for_human":
                return run
    raise AssertionError("unreachable")


async def test_a_grandchilds_approval_shows_on_the_root_and_resumes_only_it(
        services, tether, log, pool, settings):
    root = tether.parent("Assistant", "tree")
    chief = asyncio.create_task(root.run_agent_tool("Chief", {"input": "lease"}, run_id="tree-run"))
    run = await waiting_view(root)

    LEAD_RUN, CLERK_RUN = tree_runs("tree")
    assert [tuple(step.values()) for step in run.waiting_path] == [LEAD_RUN, CLERK_RUN]
    await root.continue_waiting(run, approvals=["call_0_0"])
    result = await asyncio.wait_for(chief, DEADLINE_S)
    assert result.ok and result.summary == "All done."

    resumed = {}
    for agent, name, run_id in (("Assistant", "tree", "tree-run"), LEAD_RUN, CLERK_RUN):
        history = await log.read_run(ParentRef(agent=agent, name=name), run_id)
        resumed[history.state.agent_type] = [e.type for e in history.events].count("run.resumed")
    assert resumed == {"Chief": 0, "Lead": 0, "Clerk": 1}
    assert (await runs_of(tether, "Assistant", "tree"))["tree-run"].waiting_for is None

    # The subtree's usage and cost: the run's own turns plus those of every run below.
    snapshot = await root.inspect("tree-run")
    states = [(await log.read_run(ParentRef(agent=a, name=n), r)).state
              for a, n, r in (("Assistant", "tree", "tree-run"), LEAD_RUN, CLERK_RUN)]
    own = [UsageView.of_steps(state.steps) for state in states]
    assert snapshot.usage == own[0] and own[0].total_tokens > 0
    assert snapshot.subtree_usage.total_tokens == sum(u.total_tokens for u in own)
    assert snapshot.subtree_usage.cost == pytest.approx(sum(u.cost for u in own))
    assert snapshot.subtree_usage.cost > snapshot.usage.cost > 0
    projector = Projector(pool, log, settings.projection_schema, leadership_check_s=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    await asyncio.wait_for(projector.wait_for_position(await log.stream_last_seq()), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    out = io.StringIO()
    assert await show_run(settings, ParentRef(agent="Assistant", name="tree"), "tree-run",
                          out=out) == 0
    total = snapshot.subtree_usage
    assert (f"subtree   in {total.input_tokens:,}  out {total.output_tokens:,}  cached 0  "
            f"total {total.total_tokens:,}  cost ${total.cost:.6f}  (2 runs below)") \
        in out.getvalue()


async def test_cancelling_a_run_cancels_its_open_descendants_first(services, tether, log):
    root = tether.parent("Assistant", "tree-cancel")
    LEAD_RUN, CLERK_RUN = tree_runs("tree-cancel")
    chief = asyncio.create_task(root.run_agent_tool("Chief", {"input": "lease"}, run_id="tree-run"))
    await waiting_view(root)
    await root.cancel("tree-run")
    result = await asyncio.wait_for(chief, DEADLINE_S)
    assert not result.ok and result.status == "aborted"

    cancelled_at = {}
    async with asyncio.timeout(DEADLINE_S):
        for agent, name, run_id in (("Assistant", "tree-cancel", "tree-run"), LEAD_RUN,
                                    CLERK_RUN):
            ref = ParentRef(agent=agent, name=name)
            async def aborted_history(ref: ParentRef = ref, run_id: str = run_id):
                history = await log.read_run(ref, run_id)
                return history if history.state.status == "aborted" else None

            history = await eventually(aborted_history, timeout=DEADLINE_S, interval=0.02)
            stored = await log.read_subject(log.subjects.run_events(ref, run_id))
            cancelled_at[history.state.agent_type] = next(
                e.seq for e in stored if e.event.type == "run.cancel_requested")
    assert cancelled_at["Clerk"] < cancelled_at["Lead"] < cancelled_at["Chief"]


async def test_clearing_a_run_cancels_and_purges_every_run_below_it(services, tether, log):
    root = tether.parent("Assistant", "tree-clear")
    LEAD_RUN, CLERK_RUN = tree_runs("tree-clear")
    chief = asyncio.create_task(root.run_agent_tool("Chief", {"input": "lease"}, run_id="tree-run"))
    await waiting_view(root)
    await root.clear()
    result = await asyncio.wait_for(chief, DEADLINE_S)
    assert not result.ok and result.status == "aborted"

    for agent, name, run_id in (("Assistant", "tree-clear", "tree-run"), LEAD_RUN, CLERK_RUN):
        ref = ParentRef(agent=agent, name=name)

        async def tombstone_only(ref: ParentRef = ref, run_id: str = run_id):
            stored = await log.read_subject(log.subjects.run_events(ref, run_id))
            return stored if [e.event.type for e in stored] == ["run.cleared"] else None

        await eventually(tombstone_only, timeout=DEADLINE_S, interval=0.05)
        progress = await log.read_subject(log.subjects.run_progress(ref, run_id))
        assert progress == []


async def test_two_trees_whose_runs_have_the_same_ids_are_each_their_own(services, tether, log):
    """Two parents each start the Chief under the run id `tree-run`; its Lead and Clerk
    get the same run ids in both trees. Each tree runs its own turns (two Clerks wait),
    is answered and cancelled on its own, and sums only its own usage."""
    roots = [tether.parent("Assistant", name) for name in ("tree-a", "tree-b")]
    chiefs = [asyncio.create_task(root.run_agent_tool("Chief", {"input": "lease"},
                                                      run_id="tree-run")) for root in roots]
    views = [await waiting_view(root) for root in roots]
    trees = [tree_runs("tree-a"), tree_runs("tree-b")]
    for view, tree in zip(views, trees, strict=True):
        assert [tuple(step.values()) for step in view.waiting_path] == list(tree)
    assert trees[0] != trees[1]

    await roots[0].continue_waiting(views[0], approvals=["call_0_0"])
    done = await asyncio.wait_for(chiefs[0], DEADLINE_S)
    assert done.ok and done.summary == "All done."
    (_, (agent, name, run_id)) = trees[1]
    clerk_b = (await log.read_run(ParentRef(agent=agent, name=name), run_id)).state
    assert clerk_b.paused is not None, "the other tree's Clerk still waits for its answer"

    await roots[1].cancel("tree-run")
    cancelled = await asyncio.wait_for(chiefs[1], DEADLINE_S)
    assert not cancelled.ok and cancelled.status == "aborted"
    for (agent, name, run_id), status in ((trees[0][0], "completed"), (trees[0][1], "completed")):
        state = (await log.read_run(ParentRef(agent=agent, name=name), run_id)).state
        assert (state.status, state.cancel_requested_at) == (status, None)
    snapshots = [await root.inspect("tree-run") for root in roots]
    own = [UsageView.of_steps((await log.read_run(ParentRef(agent=a, name=n), r)).state.steps)
           for a, n, r in (("Assistant", "tree-a", "tree-run"), *trees[0])]
    assert snapshots[0].subtree_usage.total_tokens == sum(u.total_tokens for u in own)


async def test_a_run_whose_child_was_aborted_by_its_own_cancel_stops_instead_of_going_on(
        services, tether, log, scripted):
    # The cascade's first pass as it lands when the runners have heard nothing yet: the
    # tree is marked cancelled, then the paused grandchild ends aborted. The Lead sees
    # its child's abort before any signal of its own cancel reaches its runner.
    lead = scripted(Lead, list(Lead.script))
    root = tether.parent("Assistant", "tree-race")
    LEAD_RUN, CLERK_RUN = tree_runs("tree-race")
    chief = asyncio.create_task(root.run_agent_tool("Chief", {"input": "lease"}, run_id="tree-run"))
    await waiting_view(root)
    cause = decide.Cause(command_seq=10**9, now=decide_now(), origin="race-test")
    lead_ref, lead_run = ParentRef(agent=LEAD_RUN[0], name=LEAD_RUN[1]), LEAD_RUN[2]
    clerk_ref, clerk_run = ParentRef(agent=CLERK_RUN[0], name=CLERK_RUN[1]), CLERK_RUN[2]
    for ref, run_id in ((ParentRef(agent="Assistant", name="tree-race"), "tree-run"),
                        (lead_ref, lead_run)):
        await log.update(ref, run_id, lambda s: decide.request_cancel(s, cause))
    await log.update(clerk_ref, clerk_run, lambda s: decide.cancel(s, cause))

    result = await asyncio.wait_for(chief, DEADLINE_S)
    assert not result.ok and result.status == "aborted", result

    # Each runner hears of its own run's cancel at its next heartbeat: the Chief's may come
    # first, so the Lead's end is waited for, not assumed to be in the log already.
    async def lead_ended():
        state = (await log.read_run(lead_ref, lead_run)).state
        return state if not state.is_open else None

    state = await eventually(lead_ended, timeout=DEADLINE_S, interval=0.02)
    assert (state.status, state.aborted_cause) == ("aborted", "cancel")
    assert len(lead.requests) == 1, "the Lead's model was not asked to go on without its child"


# --- a conversation's own tool waits for approval --------------------------------------

FILED: list[str] = []
ANSWER_CHUNK_DELAY_MS = {"ms": 0}


@tool(needs_approval=True)
async def file_paper(ctx: ToolContext, input: Paper) -> str:
    """File a paper (a human approves first)."""
    FILED.append(input.title)
    return f"filed {input.title}"


def secretary_turn(request) -> Reply:
    last = request.messages[-1]
    if last.role == "tool":
        return Reply(f"Done: {last.content}.", chunk_delay_ms=ANSWER_CHUNK_DELAY_MS["ms"])
    text = last_user(request)
    if text.startswith("file "):
        return Reply("Filing it; that needs your approval.",
                     [("file_paper", {"title": text.removeprefix("file ")})])
    return Reply(f"seen: {text}")


class Secretary(ModelParent):
    definition = AgentDefinition(id="secretary", model="tree-model", max_steps=4,
                                 tools=(file_paper,), prices=PRICES)
    script = ()


AGENTS = (*AGENTS, Secretary)


@pytest.fixture(autouse=True)
def fresh_filings():
    FILED.clear()
    ANSWER_CHUNK_DELAY_MS["ms"] = 0


async def paused_conversation(conversation) -> Any:
    """The conversation's run once its owner's timeline shows it waiting for a human."""
    async with asyncio.timeout(DEADLINE_S):
        async for view in conversation.owner.timeline():
            run = view.runs.get(conversation.name)
            if run is not None and run.waiting_for == "waiting_for_human":
                return run
    raise AssertionError("unreachable")


def steps_of(state) -> list[dict]:
    return [state.steps[i] for i in sorted(state.steps)]


async def test_an_approval_in_a_conversation_pauses_it_until_continue_answers_it(
        services, tether, scripted, log):
    client = scripted(Secretary, [secretary_turn] * 4)
    conversation = tether.conversation("Secretary", "chat-pause", owner=("User", "u1"))
    await conversation.start()
    chat = await conversation.chat()
    await conversation.send("file the lease", message_id="file")
    run = await paused_conversation(conversation)

    assert run.status == "running" and run.waiting_path == ()
    snapshot = await conversation.inspect()
    assert snapshot.waiting_for == "waiting_for_human"
    assert [(p["tool_call_id"], p["tool_name"], p["input"], p["reason"])
            for p in snapshot.pending] == [("call_0_0", "file_paper", {"title": "the lease"},
                                            "approval")]
    assert [(m.role, m.content) for m in snapshot.messages] == [
        ("user", "file the lease"), ("assistant", "Filing it; that needs your approval.")]
    assert FILED == []
    # A message sent while the conversation waits is answered after the paused call.
    await conversation.send("meanwhile: hello", message_id="later")
    await conversation.continue_run(approvals=["call_0_0"])

    reply = await asyncio.wait_for(
        conversation.reply(user_message_id(chat, "file")), DEADLINE_S)
    assert reply.content == "Done: filed the lease."
    later = await asyncio.wait_for(
        conversation.reply(user_message_id(chat, "later")), DEADLINE_S)
    assert later.content == "seen: meanwhile: hello"
    assert FILED == ["the lease"]
    assert len(client.requests) == 3
    assert tool_messages(client, 1) == {"call_0_0": "filed the lease"}
    assert last_user(client.requests[2]) == "meanwhile: hello"

    history = await log.read_run(conversation.owner.ref, "chat-pause")
    types = [e.type for e in history.events]
    assert (types.count("run.paused"), types.count("run.resumed")) == (1, 1)
    pause_id = next(e.event_id for e in history.events if e.type == "run.paused")
    assert [s["resumes"] for s in steps_of(history.state)].count(pause_id) == 1
    assert history.state.status == "running" and history.state.paused is None
    after = await conversation.inspect()
    assert (after.waiting_for, after.pending) == (None, [])
    # A second continue finds nothing waiting: refused, and the tool does not run again.
    await conversation.continue_run(approvals=["call_0_0"])
    async with asyncio.timeout(DEADLINE_S), contextlib.aclosing(
            log.follow(log.subjects.run_events(conversation.owner.ref, "chat-pause"))) as events:
        async for stored in events:
            if stored.event.type == "run.rejected":
                assert "not waiting for input" in stored.event.data.error
                break
    assert FILED == ["the lease"]
    await conversation.close()


async def test_a_paused_conversation_is_continued_once_across_runner_restarts(
        runners, tether, scripted, log):
    client = scripted(Secretary, [secretary_turn] * 4)
    ANSWER_CHUNK_DELAY_MS["ms"] = 400  # the answer streams for over a second
    first = await runners.start()
    conversation = tether.conversation("Secretary", "chat-restart", owner=("User", "u1"))
    owner = conversation.owner.ref
    await conversation.start()
    chat = await conversation.chat()
    await conversation.send("file the lease", message_id="file")
    await paused_conversation(conversation)
    before = await conversation.inspect()

    # The runner goes away while the conversation waits; a new one finds it as it was.
    await runners.stop(first)
    second = await runners.start()
    assert await conversation.inspect() == before
    assert before.pending[0]["tool_call_id"] == "call_0_0"
    assert before.usage.total_tokens > 0 and before.usage.cost > 0

    # Continued: the second runner takes the answers in, and stops as the answer streams.
    await conversation.continue_run(approvals=["call_0_0"])
    async with asyncio.timeout(DEADLINE_S), contextlib.aclosing(
            log.follow(log.subjects.run_events(owner, "chat-restart"))) as events:
        async for stored in events:
            event = stored.event
            if event.type == "run.output" and event.data.text.startswith("\n\nDone"):
                break  # the answers are recorded, and the model's answer is streaming
    await runners.stop(second)
    await runners.start()

    reply = await asyncio.wait_for(
        conversation.reply(user_message_id(chat, "file")), DEADLINE_S)
    assert reply.content == "Done: filed the lease."
    assert FILED == ["the lease"], "the approved tool ran once"
    history = await log.read_run(owner, "chat-restart")
    types = [e.type for e in history.events]
    assert [e.data.attempt for e in history.events if e.type == "run.running"] == [1, 2, 3]
    assert (types.count("run.paused"), types.count("run.resumed")) == (1, 1)
    steps = steps_of(history.state)
    pause_id = next(e.event_id for e in history.events if e.type == "run.paused")
    assert [s["resumes"] for s in steps].count(pause_id) == 1, "the answers were taken in once"
    # The answer's turn was not recorded when the runner stopped: asked again, once.
    assert [last.role for last in (r.messages[-1] for r in client.requests)] == [
        "user", "tool", "tool"]
    stored, _ = await log.read_stored(log.subjects.chat_stream,
                                      log.subjects.chat(*chat))
    chat = [ChatMessage.model_validate_json(m.data) for m in stored]
    assert [(m.id, m.content) for m in chat if from_model(m)] == [
        (reply.id, "Done: filed the lease.")], "one answer"

    # After the restarts, inspect has the whole conversation and its usage.
    snapshot = await conversation.inspect()
    assert [(m.role, m.content) for m in snapshot.messages] == [
        ("user", "file the lease"), ("assistant", "Filing it; that needs your approval."),
        ("tool", "filed the lease"), ("assistant", "Done: filed the lease.")]
    assert snapshot.pending == [] and snapshot.waiting_for is None
    assert snapshot.usage == UsageView.of_steps(history.state.steps)
    assert snapshot.usage.total_tokens > before.usage.total_tokens
    await conversation.close()


async def test_a_conversation_whose_runner_died_before_its_pause_was_logged_pauses_once(
        runners, tether, scripted, log, monkeypatch):
    client = scripted(Secretary, [secretary_turn] * 4)
    dying = asyncio.Event()
    pause = Execution._pause

    async def die_before_pausing(self, awaiting) -> None:
        dying.set()
        await asyncio.Event().wait()  # the runner dies here, its step records written

    monkeypatch.setattr(Execution, "_pause", die_before_pausing)
    first = await runners.start()
    conversation = tether.conversation("Secretary", "chat-died", owner=("User", "u1"))
    await conversation.start()
    chat = await conversation.chat()
    await conversation.send("file the lease", message_id="file")
    await asyncio.wait_for(dying.wait(), DEADLINE_S)
    state = (await log.read_run(conversation.owner.ref, "chat-died")).state
    assert state.paused is None and steps_of(state)[-1]["status"] == "waiting_for_human"

    monkeypatch.setattr(Execution, "_pause", pause)
    await runners.stop(first)
    await runners.start()
    await paused_conversation(conversation)
    assert len(client.requests) == 1, "the recorded turn was not asked for again"
    await conversation.continue_run(approvals=["call_0_0"])
    reply = await asyncio.wait_for(
        conversation.reply(user_message_id(chat, "file")), DEADLINE_S)
    assert reply.content == "Done: filed the lease." and FILED == ["the lease"]
    history = await log.read_run(conversation.owner.ref, "chat-died")
    assert [e.type for e in history.events].count("run.paused") == 1
    await conversation.close()
