"""`tether ui` over HTTP against real NATS and Postgres: the pages' JSON, the live stream,
the state as of a sequence, the actions' commands and their errors.

The events are appended directly and projected by an in-process projector; no parent
service runs, so an action is checked by the command it puts on the commands stream.
"""

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from eventually import eventually
from misplaced_events import publish_misplaced
from projecting import running_projector
from runner_stack import Stack
from ui_server import running_ui

from tether import ChildAgent, RunContext
from tether.adapters.event_log import EventLog
from tether.adapters.postgres.reads import ProjectionReads
from tether.agents.devtools import load_tree, render_run
from tether.client import connect
from tether.config import Settings
from tether.contract.codec import encode_event
from tether.contract.messages import ProgressSignal
from tether.domain import events as ev
from tether.domain.commands import DeliveredCommand
from tether.domain.delivery_batches import batch_of
from tether.domain.events import ParentRef
from tether.domain.ids import finish_message_id, nested_parent_name
from tether.testing import RunEvents
from tether.ui.page_stream import ParentStream

PARENT = ParentRef(agent="Assistant", name="user-1")
OTHER = ParentRef(agent="Assistant", name="user-2")


async def append(log: EventLog, *events: ev.Event) -> int:
    seq = 0
    for event in events:
        seq = await log.append(event, expected_last_seq=None)
    return seq


@pytest.fixture
async def projector(pool, log, settings):
    async with running_projector(pool, log, settings.projection_schema) as running:
        yield running


@pytest.fixture
async def ui(projector, settings):
    async with running_ui(settings) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


class Stream:
    """The server-sent events of one page's stream, as (event, data) pairs."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self, timeout: float = 10) -> tuple[str, dict]:
        kind, data = "", ""
        async with asyncio.timeout(timeout):
            async for line in self._lines:
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                elif line == "" and kind:
                    return kind, json.loads(data)
        raise AssertionError("the stream ended")

    async def until(self, predicate, timeout: float = 10) -> list[dict]:
        """Messages up to the first one `predicate` accepts (included)."""
        seen = []
        async with asyncio.timeout(timeout):
            while True:
                _, message = await self.next(timeout)
                seen.append(message)
                if predicate(message):
                    return seen


@asynccontextmanager
async def stream(client: httpx.AsyncClient, parent: ParentRef) -> AsyncIterator[Stream]:
    async with client.stream("GET", f"/api/parents/{parent.agent}/{parent.name}/stream") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        yield Stream(r)


def a_run(run_id: str, parent: ParentRef = PARENT) -> RunEvents:
    return RunEvents(run_id, parent, start_ms=1_700_000_000_000)


async def test_the_index_lists_parents_with_their_counts_by_status_and_searches(
        ui, log, projector):
    done, failed, other = a_run("r1"), a_run("r2"), a_run("r3", OTHER)
    seq = await append(log, done.requested(), done.started(), done.completed(),
                       failed.requested(), failed.failed(), other.requested())
    await asyncio.wait_for(projector.wait_for_position(seq), 10)

    parents = (await ui.get("/api/parents")).json()["parents"]
    assert [(p["agent"], p["name"], p["total"]) for p in parents] == [
        ("Assistant", "user-1", 2), ("Assistant", "user-2", 1)]
    counts = parents[0]["counts"]
    assert (counts["completed"], counts["error"], counts["starting"]) == (1, 1, 0)
    assert parents[1]["counts"]["starting"] == 1
    assert [p["name"] for p in (await ui.get("/api/parents?q=USER-2")).json()["parents"]] == [
        "user-2"]
    page = await ui.get("/")
    assert page.status_code == 200 and 'data-page="index"' in page.text


async def test_the_stream_starts_from_the_projection_and_follows_the_log(ui, log, projector):
    old = a_run("old")
    seq = await append(log, old.requested(), old.started(), old.running(),
                       old.milestone("first"), old.completed("earlier"))
    await asyncio.wait_for(projector.wait_for_position(seq), 10)

    async with stream(ui, PARENT) as page:
        kind, snapshot = await page.next()
        assert kind == "snapshot" and snapshot["checkpoint"] >= seq
        [run] = snapshot["runs"]
        assert (run["run_id"], run["status"], run["summary"]) == ("old", "completed", "earlier")
        assert [m["name"] for m in run["milestones"]] == ["first"]

        new = a_run("new")
        await append(log, new.requested(display="Looking it up"), new.started(), new.running(),
                     new.milestone("a"), new.milestone("b"), new.output("partial "),
                     new.output("text"), new.progress(0.4, "reading"))
        updates = await page.until(lambda m: any(
            r["run_id"] == "new" and r["progress"] and r["progress"]["fraction"] == 0.4
            for r in m["runs"]))
        latest = [r for m in updates for r in m["runs"] if r["run_id"] == "new"][-1]
        assert latest["display"] == "Looking it up" and latest["status"] == "running"
        assert latest["progress"]["fraction"] == 0.4 and latest["progress"]["message"] == "reading"
        assert [(m["sequence"], m["name"]) for m in latest["milestones"]] == [(0, "a"), (1, "b")]
        assert latest["output_text"] == "partial text"
        assert latest["attempt"] == 1 and not latest["finished"]

        await append(log, new.completed("found it"))
        await page.until(lambda m: any(r["run_id"] == "new" and r["status"] == "completed"
                                       for r in m["runs"]))
        await append(log, old.cleared())
        await page.until(lambda m: m["removed"] == ["old"])


async def test_a_burst_reaches_the_page_coalesced_per_frame(log, pool, settings, projector):
    run = a_run("busy")
    await append(log, run.requested(), run.started(), run.running())
    # The app's default frame (250 ms): the burst below is published in far less.
    async with (running_ui(settings) as url,
                httpx.AsyncClient(base_url=url, timeout=10) as ui,
                stream(ui, PARENT) as page):
        kind, _ = await page.next()
        assert kind == "snapshot"
        acks = [await log.jetstream.publish_async(
            log.subjects.run_events(PARENT, "busy"), encode_event(event),
            headers={"Nats-Msg-Id": event.event_id})
            for event in (run.output(f"{i} ") for i in range(300))]
        await asyncio.gather(*acks)
        updates = await page.until(lambda m: any(
            r["output_text"].endswith("299 ") for r in m["runs"]))
    frames = [m for m in updates if m["runs"]]
    assert len(frames) < 20, f"{len(frames)} frames for one burst of 300 events"
    assert all(len(m["runs"]) == 1 for m in frames), "one document per run per frame"
    gaps = [b["sent_at"] - a["sent_at"] for a, b in itertools.pairwise(frames)]
    assert all(gap >= 240 for gap in gaps), gaps


async def test_the_run_page_shows_steps_a_child_recorded_in_its_own_shape(ui, log, projector):
    """A remote child's or a framework child's steps are not a model agent's records: the
    page lists them as they are, and counts the usage they carry."""
    run = a_run("r-own")
    task = {"kind": "a2a.task", "url": "http://agents.example/x", "task_id": "t-1"}
    call = {"kind": "model", "key": "0:model:0", "turn": {"usage": {
        "input_tokens": 7, "output_tokens": 3}}}
    seqs = [await append(log, event) for event in (
        run.requested(), run.started(), run.running(),
        run.make(ev.RunStepRecorded, index=0, step=task),
        run.make(ev.RunStepRecorded, index=1, step=call), run.completed("ok"))]
    await asyncio.wait_for(projector.wait_for_position(seqs[-1]), 10)
    detail = (await ui.get("/api/runs/Assistant/user-1/r-own")).json()
    assert [(s["index"], s["kind"], s["step"]) for s in detail["steps"]] == [
        (0, "a2a.task", task), (1, "model", call)]
    assert detail["usage"] == {"input_tokens": 7, "output_tokens": 3, "cached_tokens": 0,
                               "total_tokens": 10, "cost": None}
    shown = render_run((await log.read_run(PARENT, "r-own")).state)
    assert "step 0    a2a.task  " in shown and "t-1" in shown
    assert "usage     in 7  out 3  cached 0  total 10  cost unknown" in shown


async def test_the_run_page_folds_its_events_up_to_any_sequence(ui, log, projector):
    run = a_run("r-seq")
    seqs = [await append(log, event) for event in (
        run.requested(), run.started(), run.running(), run.milestone("half"),
        run.output("hello"), run.completed("all done"))]
    await asyncio.wait_for(projector.wait_for_position(seqs[-1]), 10)

    detail = (await ui.get("/api/runs/Assistant/user-1/r-seq")).json()
    assert [e["seq"] for e in detail["events"]] == seqs
    assert [e["type"] for e in detail["events"]] == [
        "run.requested", "run.started", "run.running", "run.milestone", "run.output",
        "run.completed"]
    assert detail["run"]["status"] == "completed" and detail["steps"] == []

    async def as_of(seq: int) -> dict | None:
        answer = await ui.get(f"/api/runs/Assistant/user-1/r-seq/state?seq={seq}")
        assert answer.status_code == 200
        return answer.json()["run"]

    assert await as_of(seqs[0] - 1) is None
    assert (await as_of(seqs[0]))["status"] == "starting"
    at_milestone = await as_of(seqs[3])
    assert (at_milestone["status"], [m["name"] for m in at_milestone["milestones"]],
            at_milestone["output_text"]) == ("running", ["half"], "")
    assert (await as_of(seqs[4]))["output_text"] == "hello"
    assert (await as_of(seqs[5]))["summary"] == "all done"
    page = await ui.get("/runs/Assistant/user-1/r-seq")
    assert page.status_code == 200 and 'data-page="run"' in page.text

    bad = await ui.get("/api/runs/Assistant/user-1/r-seq/state?seq=soon")
    assert bad.status_code == 400 and "seq" in bad.json()["error"]


async def test_unknown_or_malformed_parents_and_runs_are_404(ui):
    for path in ("/runs/Assistant/user-1/nope", "/api/runs/Assistant/user-1/nope",
                 "/parents/Bad%20Agent/x", "/runs/Assistant/user-1/bad%20id"):
        answer = await ui.get(path)
        assert answer.status_code == 404, path
    assert "no run nope of Assistant/user-1" in (
        await ui.get("/api/runs/Assistant/user-1/nope")).json()["error"]
    assert (await ui.get("/parents/Assistant/nobody-yet")).status_code == 200


async def last_command(log: EventLog, kind: str, parent: ParentRef = PARENT) -> dict:
    message = await log.jetstream.get_last_msg(log.subjects.commands_stream,
                                               log.subjects.command_for(kind, parent))
    return json.loads(message.data)


async def test_actions_send_the_commands_of_the_client(ui, log, projector):
    open_run, stuck, paused, spent = a_run("open"), a_run("stuck"), a_run("paused"), a_run("spent")
    pending = [{"tool_call_id": "call-1", "tool_name": "publish", "input": {},
                "reason": "approval"}]
    seq = await append(
        log, open_run.requested(), open_run.started(),
        stuck.requested("Importer", input={"rows": 5}, display="Import"), stuck.started(),
        stuck.interrupted(),
        paused.requested(), paused.started(), paused.running(),
        paused.make(ev.RunPaused, reason="waiting_for_human", pending=pending),
        spent.requested(), spent.started(), spent.make(ev.RunCancelRequested, reason="give-up"),
        spent.interrupted("budget-exceeded"))
    await asyncio.wait_for(projector.wait_for_position(seq), 10)

    answer = await ui.post("/api/runs/Assistant/user-1/open/cancel", json={})
    # (No parent service runs: the answer says the cancel waits, and for how long.)
    assert answer.json() == {"ok": True, "message": "cancel requested for open; queued: no "
                             "parent service is running; it expires in 60 s"}
    assert (await last_command(log, "cancel"))["run_id"] == "open"

    assert (await ui.post("/api/runs/Assistant/user-1/stuck/rerequest", json={})).status_code == 200
    command = await last_command(log, "run")
    assert (command["run_id"], command["agent_type"], command["input"], command["display"]) == (
        "stuck", "Importer", {"rows": 5}, "Import")
    refused = await ui.post("/api/runs/Assistant/user-1/open/rerequest", json={})
    assert refused.status_code == 409 and "only an interrupted run" in refused.json()["error"]
    refused = await ui.post("/api/runs/Assistant/user-1/spent/rerequest", json={})
    assert refused.status_code == 409 and "does not resume" in refused.json()["error"]

    answer = await ui.post("/api/runs/Assistant/user-1/paused/continue",
                           json={"approvals": ["call-1"]})
    assert answer.status_code == 200
    command = await last_command(log, "continue")
    assert (command["run_id"], command["approvals"]) == ("paused", ["call-1"])
    bad = await ui.post("/api/runs/Assistant/user-1/paused/continue",
                        json={"approvals": "call-1"})
    assert bad.status_code == 400 and bad.json()["error"].startswith(
        "invalid continue request: approvals")
    form = await ui.post("/api/runs/Assistant/user-1/open/cancel",
                         data={"from": "another site"})
    assert form.status_code == 415 and "Content-Type: application/json" in form.json()["error"]
    not_json = await ui.post("/api/runs/Assistant/user-1/paused/continue", content=b"{",
                             headers={"Content-Type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]
    not_paused = await ui.post("/api/runs/Assistant/user-1/open/continue", json={})
    assert not_paused.status_code == 409

    assert (await ui.post("/api/parents/Assistant/user-1/clear", json={})).status_code == 200
    assert (await last_command(log, "clear"))["status"] == [
        "completed", "error", "aborted", "interrupted"]
    bad = await ui.post("/api/parents/Assistant/user-1/clear", json={"status": ["done"]})
    assert bad.status_code == 400 and "status" in bad.json()["error"]


async def test_actions_decide_from_the_log_when_the_projections_lag_it(log, pool, settings):
    """The projector stops (it is down, or behind): what happens next is only in the log,
    and the actions act on it."""
    twice, late, stuck = a_run("twice"), a_run("late"), a_run("stuck")

    def pause(run: RunEvents, call: str) -> ev.Event:
        return run.make(ev.RunPaused, reason="waiting_for_human", pending=[
            {"tool_call_id": call, "tool_name": "publish", "input": {}, "reason": "approval"}])

    first = pause(twice, "call-1")
    async with running_projector(pool, log, settings.projection_schema) as projector:
        seq = await append(log, twice.requested(), twice.started(), twice.running(), first,
                           late.requested(), late.started(), late.running(),
                           stuck.requested("Importer", input={"rows": 5}), stuck.started())
        await asyncio.wait_for(projector.wait_for_position(seq), 10)
    async with running_ui(settings) as url, httpx.AsyncClient(base_url=url, timeout=10) as ui:
        answer = await ui.post("/api/runs/Assistant/user-1/twice/continue",
                               json={"approvals": ["call-1"]})
        assert answer.status_code == 200, answer.json()
        assert (await last_command(log, "continue"))["approvals"] == ["call-1"]
        # Paused again, while the projections still show the first pause: the answer is a
        # command of its own, not a duplicate of the first answer's.
        await append(log, twice.make(ev.RunResumed, pause_id=first.event_id,
                                     decisions={"approvals": ["call-1"]}),
                     pause(twice, "call-2"))
        answer = await ui.post("/api/runs/Assistant/user-1/twice/continue",
                               json={"approvals": ["call-2"]})
        assert answer.status_code == 200, answer.json()
        assert (await last_command(log, "continue"))["approvals"] == ["call-2"]

        # Paused, or interrupted, after the projections last saw it running.
        await append(log, pause(late, "call-3"), stuck.interrupted())
        assert (await ui.get("/api/runs/Assistant/user-1/late")).json()["run"][
            "status"] == "running", "the projections lag the log"
        answer = await ui.post("/api/runs/Assistant/user-1/late/continue",
                               json={"approvals": ["call-3"]})
        assert answer.status_code == 200, answer.json()
        assert (await last_command(log, "continue"))["approvals"] == ["call-3"]
        answer = await ui.post("/api/runs/Assistant/user-1/stuck/rerequest", json={})
        assert answer.status_code == 200, answer.json()
        assert (await last_command(log, "run"))["run_id"] == "stuck"


async def test_health_and_readiness(ui):
    assert (await ui.get("/healthz")).json() == {"status": "alive"}
    ready = await ui.get("/readyz")
    assert ready.status_code == 200 and set(ready.json()["checks"]) == {"nats", "postgres"}


async def test_a_run_the_projector_has_not_seen_yet_is_read_from_the_log(log, pool, settings):
    run = a_run("fresh")
    await append(log, run.requested(), run.started())
    # No projector runs: the run is only in the log.
    async with running_ui(settings) as url, httpx.AsyncClient(base_url=url, timeout=10) as ui:
        detail = (await ui.get("/api/runs/Assistant/user-1/fresh")).json()
        assert detail["run"]["status"] == "starting"
        assert [e["type"] for e in detail["events"]] == ["run.requested", "run.started"]
        assert (await ui.get("/runs/Assistant/user-1/fresh")).status_code == 200
        assert (await ui.get("/runs/Assistant/user-1/never")).status_code == 404


async def test_a_page_shows_its_own_trees_runs_and_not_anothers_of_the_same_ids(
        ui, log, projector, settings):
    """PARENT and OTHER each have a run `digest` whose nested run is `digest-part-0`:
    each page, and `tether runs show`, has its own tree's nested run only."""
    seq = 0
    for parent, summary in ((PARENT, "mine"), (OTHER, "theirs")):
        root = RunEvents("digest", parent, start_ms=1_700_000_000_000,
                         id_prefix=f"{parent.name}-root")
        requested = root.requested("Coordinator")
        owner = ParentRef(agent="Coordinator", name=requested.data.nested_parent)
        part = RunEvents("digest-part-0", owner, start_ms=1_700_000_000_000,
                         id_prefix=f"{parent.name}-part")
        seq = await append(log, requested, root.started(), root.running(),
                           part.requested("Summarizer"), part.started(), part.completed(summary))
    await asyncio.wait_for(projector.wait_for_position(seq), 10)

    for parent, summary in ((PARENT, "mine"), (OTHER, "theirs")):
        async with stream(ui, parent) as page:
            kind, snapshot = await page.next()
        assert kind == "snapshot"
        assert [(r["run_id"], r["summary"]) for r in snapshot["nested"]] == [
            ("digest-part-0", summary)]
        _, below = await load_tree(settings, parent, "digest")
        assert [(state.run_id, state.summary) for state in below] == [
            ("digest-part-0", summary)]


async def test_nested_runs_come_under_the_run_that_started_them(ui, log, projector):
    coordinator = a_run("digest")
    owner = ParentRef(agent="Coordinator",
                      name=nested_parent_name(PARENT.agent, PARENT.name, "digest"))
    first = a_run("digest-part-0", owner)
    seq = await append(log, coordinator.requested("Coordinator"), coordinator.started(),
                       coordinator.running(), first.requested("Summarizer"), first.started(),
                       first.completed("part one"))
    await asyncio.wait_for(projector.wait_for_position(seq), 10)

    async with stream(ui, PARENT) as page:
        kind, snapshot = await page.next()
        assert kind == "snapshot" and [r["run_id"] for r in snapshot["runs"]] == ["digest"]
        assert [(r["parent"], r["run_id"], r["summary"]) for r in snapshot["nested"]] == [
            ({"agent": "Coordinator", "name": owner.name}, "digest-part-0", "part one")]
        # The coordinator is open: a nested run it starts later reaches the page too.
        second = a_run("digest-part-1", owner)
        await append(log, second.requested("Summarizer"), second.started())
        await page.until(lambda m: any(r["run_id"] == "digest-part-1"
                                       for r in m.get("nested", [])))
    assert (await ui.get(f"/parents/Coordinator/{owner.name}")).status_code == 200


async def test_a_page_shows_a_delivery_recorded_in_its_agents_ledger_batch(log, pool, settings):
    """A batch on the parent agent's delivery ledger, with a run of this page's parent and
    one of another parent of the agent: the page's run shows its hook delivered, live."""
    states = []
    for parent, run_id in ((PARENT, "led-page"), (OTHER, "led-other")):
        run = RunEvents(run_id, parent)
        await append(log, run.requested(detached={"on_finish": "on_done"}), run.running(),
                     run.completed())
        states.append((await log.read_run(parent, run_id)).state)
    async with connect(settings=settings) as tether:
        page = ParentStream(tether, ProjectionReads(pool, settings.projection_schema), PARENT,
                            frame_ms=10)
        messages = page.messages()
        seen = {r["run_id"] for r in (await anext(messages))["runs"]}  # the snapshot
        batch, _ = batch_of([DeliveredCommand(
            run_id=state.run_id, parent=state.parent, status="completed", method="on_done",
            message_id=finish_message_id(state, "completed", "on_done")) for state in states],
            now=4_242)
        await log.record_deliveries(batch)

        async def delivered() -> list:
            runs = (await anext(messages)).get("runs", [])
            seen.update(r["run_id"] for r in runs)
            return [(r["run_id"], r["delivered_at"]) for r in runs
                    if r["delivered_at"] is not None]

        assert await eventually(delivered, timeout=10, interval=0) == [("led-page", 4_242)]
        await messages.aclose()
    assert seen == {"led-page"}


async def test_a_page_applies_no_event_stored_where_it_does_not_belong_and_says_so(
        log, pool, settings):
    """Another run's `run.completed` on a run's subject, another tenant's run on one of
    this parent's subjects, a message that is no event (a buggy client, a hand-run
    `nats pub`): the page applies none of them, as the projector, and its next frame
    names each."""
    la, lb = a_run("la"), a_run("lb")
    await append(log, la.requested(), la.running(), lb.requested(), lb.running())
    async with connect(settings=settings) as tether:
        page = ParentStream(tether, ProjectionReads(pool, settings.projection_schema), PARENT,
                            frame_ms=10)
        messages = page.messages()
        updates = [await anext(messages)]  # the snapshot, at the projection's checkpoint
        placed = await publish_misplaced(log, PARENT, la, lb)
        la_subject, lc_subject = placed.la_subject, placed.lc_subject
        liar_seq, foreign_seq, garbage_seq = placed.liar, placed.foreign, placed.garbage
        liar = ProgressSignal(run_id="lb", parent=PARENT, fraction=0.9, at=1_800_000_000_000)
        la_progress = log.subjects.run_progress(PARENT, "la")
        signal_seq = (await log.jetstream.publish(la_progress, liar.model_dump_json().encode(),
                                                  stream=log.subjects.progress_stream)).seq
        await append(log, la.completed("done"))

        async def all_arrived() -> bool:  # the two streams' messages, in either order
            updates.append(await anext(messages))
            return any(r["run_id"] == "la" and r["status"] == "completed"
                       for m in updates for r in m.get("runs", [])) and any(
                u["line"].startswith("progress signal")
                for m in updates for u in m.get("unreadable", []))

        await eventually(all_arrived, timeout=10, interval=0)
        await messages.aclose()
    latest = {r["run_id"]: (r["status"], r["progress"])
              for m in updates for r in m.get("runs", [])}
    assert latest == {"la": ("completed", None), "lb": ("running", None)}
    unreadable = [u for m in updates for u in m.get("unreadable", [])]
    events = [u for u in unreadable if u["line"].startswith("event")]
    assert [(u["seq"], u["subject"]) for u in events] == [
        (liar_seq, la_subject), (foreign_seq, lc_subject), (garbage_seq, la_subject)]
    assert events[0]["line"] == (f"event at seq {liar_seq} could not be read: names "
                                 f"Assistant/user-1/lb, stored on {la_subject}")
    assert events[2]["reason"].startswith("not JSON")
    [signal] = [u for u in unreadable if u["line"].startswith("progress signal")]
    assert signal["line"] == (f"progress signal at seq {signal_seq} could not be read: names "
                              f"Assistant/user-1/lb, stored on {la_progress}")
    assert sum(m.get("unreadable_count", 0) for m in updates) == 4


async def test_a_quiet_stream_sends_heartbeats(log, pool, settings):
    async with connect(settings=settings) as tether:
        page = ParentStream(tether, ProjectionReads(pool, settings.projection_schema), PARENT,
                            heartbeat_s=0.05)
        messages = page.messages()
        kinds = [(await anext(messages))["type"] for _ in range(4)]
        await messages.aclose()
    assert kinds == ["snapshot", "update", "heartbeat", "heartbeat"]


async def test_missing_projections_are_a_503_that_names_the_schema(log, nats_url, database_url):
    settings = Settings(nats_url=nats_url, database_url=database_url, prefix=log.subjects.prefix,
                        projection_schema="never_migrated")
    async with running_ui(settings) as url, httpx.AsyncClient(base_url=url, timeout=10) as ui:
        answer = await ui.get("/api/parents")
        assert answer.status_code == 503
        assert "schema 'never_migrated'" in answer.json()["error"]
        assert "projector" in answer.json()["error"]
        page = await ui.get("/parents/Assistant/user-1")
        assert page.status_code == 200  # the page itself; its stream says what failed
        async with stream(ui, PARENT) as events:
            kind, failure = await events.next()
        assert kind == "failure" and "never_migrated" in failure["error"]
        stream_answer = await ui.get("/runs/Assistant/user-1/r1")
        assert stream_answer.status_code == 503 and "never_migrated" in stream_answer.text


class Quiet(ChildAgent):
    """Registered with the parent only: no runner takes its runs, which stay starting."""

    async def run(self, ctx: RunContext, input: Any) -> str:
        raise AssertionError("no runner runs it")


async def test_the_run_page_sends_a_message_and_the_run_shows_it(ui, settings, log, pool,
                                                                 projector):
    async with connect(settings=settings) as tether:
        stack = Stack(settings, log, pool, tether, [Quiet])
        await stack.start_parent()
        try:
            me = tether.parent(PARENT.agent, PARENT.name)
            await me.run_agent_tool("Quiet", {}, run_id="quiet", detached=True)
            answer = await ui.post("/api/runs/Assistant/user-1/quiet/send",
                                   json={"text": "use QUIC", "mode": "interrupt"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["message"].endswith("sent to quiet")
            bad = await ui.post("/api/runs/Assistant/user-1/quiet/send", json={"text": " "})
            assert bad.status_code == 400 and bad.json()["error"].startswith("text:")
            bad = await ui.post("/api/runs/Assistant/user-1/quiet/send",
                                json={"text": "x", "mode": "loud"})
            assert bad.status_code == 400 and bad.json()["error"].startswith("mode:")

            async def shown():
                detail = (await ui.get("/api/runs/Assistant/user-1/quiet")).json()
                return detail["run"]["messages"] or None

            (message,) = await eventually(shown, timeout=10)
            assert (message["text"], message["mode"], message["consumed_at"]) == (
                "use QUIC", "interrupt", None)
            await me.cancel("quiet")

            async def cancelled():
                detail = (await ui.get("/api/runs/Assistant/user-1/quiet")).json()
                return detail["run"]["finished"]

            await eventually(cancelled, timeout=10)
            refused = await ui.post("/api/runs/Assistant/user-1/quiet/send", json={"text": "x"})
            assert refused.status_code == 409 and "aborted" in refused.json()["error"]
        finally:
            await stack.close()
