"""The UI's refusals and what its actions say when no parent service runs: a 4xx naming
the field, never a 500; a command that waits for a parent says so, and expires.

No parent service runs here (as in test_ui.py): a command is checked on the commands
stream."""

import asyncio
import json

import httpx
import pytest
from projecting import running_projector
from ui_server import running_ui

from tether.adapters.event_log import EventLog
from tether.client import connect
from tether.domain import events as ev
from tether.domain.events import ParentRef
from tether.testing import RunEvents

PARENT = ParentRef(agent="Assistant", name="user-1")
RUN = "/api/runs/Assistant/user-1"
QUEUED = "queued: no parent service is running; it expires in 60 s"
PENDING = [{"tool_call_id": "call-1", "tool_name": "publish", "input": {}, "reason": "approval"}]


@pytest.fixture
async def ui(pool, log, settings):
    async with running_projector(pool, log, settings.projection_schema) as projector:
        runs = {run_id: RunEvents(run_id, PARENT, start_ms=1_700_000_000_000)
                for run_id in ("open", "done", "paused", "failed", "stuck")}
        seq = 0
        for event in (runs["open"].requested(), runs["open"].started(),
                      runs["done"].requested(), runs["done"].started(), runs["done"].completed(),
                      runs["paused"].requested(), runs["paused"].started(),
                      runs["paused"].running(),
                      runs["paused"].make(ev.RunPaused, reason="waiting_for_human",
                                          pending=PENDING),
                      runs["failed"].requested(), runs["failed"].failed(),
                      runs["stuck"].requested(), runs["stuck"].started(),
                      runs["stuck"].interrupted()):
            seq = await log.append(event, expected_last_seq=None)
        await asyncio.wait_for(projector.wait_for_position(seq), 10)
        async with running_ui(settings) as url, \
                httpx.AsyncClient(base_url=url, timeout=20) as client:
            yield client


async def last_command(log: EventLog, kind: str) -> dict:
    message = await log.jetstream.get_last_msg(log.subjects.commands_stream,
                                               log.subjects.command_for(kind, PARENT))
    return json.loads(message.data)


async def test_too_long_text_or_fork_point_is_a_400_naming_the_field(ui):
    too_long = await ui.post(f"{RUN}/open/send", json={"text": "y" * 100_001})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"] == "text: at most 100,000 characters, not 100,001"
    at = await ui.post(f"{RUN}/open/fork", json={"at": "milestone:" + "m" * 300})
    assert at.status_code == 400, at.text
    assert at.json()["error"].startswith("at: String should have at most 256 characters")


async def test_a_command_too_large_for_nats_is_a_413_with_the_limit(ui):
    answer = await ui.post(f"{RUN}/paused/continue",
                           json={"tool_outputs": {"call-1": "x" * 2_000_000}})
    assert answer.status_code == 413, answer.text
    assert "max_payload" in answer.json()["error"]


async def test_a_sequence_is_ascii_digits_only(ui):
    for seq in ("-5", "٣", "+3", " 3", ""):
        answer = await ui.get(f"{RUN}/done/state", params={"seq": seq})
        assert answer.status_code == 400, (seq, answer.text)
        assert answer.json()["error"].startswith("seq: expected the stream sequence")
    assert (await ui.get(f"{RUN}/done/state", params={"seq": "0"})).status_code == 200


@pytest.mark.parametrize("field", ["run_id", "parent"])
async def test_continue_refuses_what_the_path_gives(ui, field):
    answer = await ui.post(f"{RUN}/paused/continue", json={field: "x", "approvals": ["call-1"]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == f"{field}: given by the path"


async def test_without_a_parent_service_actions_say_they_are_queued_and_expire(ui, log):
    expires_in_ms = 60_000  # as the CLI's default
    for path, kind in ((f"{RUN}/open/cancel", "cancel"),
                       ("/api/parents/Assistant/user-1/clear", "clear"),
                       (f"{RUN}/paused/continue", "continue"),
                       (f"{RUN}/open/send", "send"),
                       (f"{RUN}/stuck/rerequest", "run")):
        body = ({"approvals": ["call-1"]} if kind == "continue" else
                {"text": "hello"} if kind == "send" else {})
        answer = await ui.post(path, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["message"].endswith(f"; {QUEUED}"), answer.text
        assert (await last_command(log, kind))["expires_in_ms"] == expires_in_ms


async def test_without_a_parent_service_a_fork_or_rewind_is_a_503_saying_so(ui, log):
    async with asyncio.timeout(15):  # the look for a parent, not the client's 30 s wait
        fork = await ui.post(f"{RUN}/done/fork", json={"at": "step:1"})
        rewind = await ui.post(f"{RUN}/failed/rewind", json={})
    for answer, what in ((fork, "fork of done"), (rewind, "rewind of failed")):
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error.startswith(f"{what}: no parent service is running, nothing was sent: "
                                "no parent service answers"), error
        assert "tether services parent" in error
    info = await log.jetstream.stream_info(log.subjects.commands_stream)
    assert info.state.messages == 0


@pytest.mark.parametrize("branch", ["fork", "rewind"])
async def test_a_fork_or_rewind_request_carries_its_expiry(settings, log, ui, branch):
    async with connect(settings=settings) as tether:
        me = tether.parent(PARENT.agent, PARENT.name)
        with pytest.raises(TimeoutError):
            if branch == "fork":
                await me.fork("done", at="step:1", detached=True, expires_in=60,
                              timeout=0.5, on_waiting=lambda text: None)
            else:
                await me.rewind("failed", detached=True, expires_in=60, timeout=0.5,
                                on_waiting=lambda text: None)
    assert (await last_command(log, "run"))["expires_in_ms"] == 60_000


async def test_a_send_no_parent_recorded_says_when_it_is_dropped(settings, log):
    async with connect(settings=settings) as tether:
        me = tether.parent(PARENT.agent, PARENT.name)
        with pytest.raises(TimeoutError) as waited:
            await me.send("open", "hello", expires_in=60, timeout=0.5)
    assert str(waited.value).endswith(
        "is applied when a parent service with prefix "
        f"{settings.prefix!r} takes it, unless that is more than 60 s after it was sent: "
        "then it is dropped")
