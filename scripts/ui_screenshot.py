"""Regenerates docs/images/ui-timeline.png (or the PNG file given): one parent's timeline
in `tether ui`.

    .venv/bin/python scripts/devstack.py test -- .venv/bin/python scripts/ui_screenshot.py [PNG]

A throwaway prefix and schema on the servers of $TETHER_NATS_URL / $TETHER_DATABASE_URL
get a made-up parent (runs grouped by tool call, a nested run, a run waiting for an
approval, an interrupted one, a detached import with its budgets); the projector and the
UI run in this process and headless Chromium (Debian's `chromium`) takes the picture.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import msgspec
from playwright.async_api import async_playwright

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.migrator import migrate
from tether.adapters.postgres.projector import Projector
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.config import Settings
from tether.domain import events as ev
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef
from tether.domain.ids import nested_parent_name
from tether.testing import RunEvents
from tether.ui.serving import serve_ui

OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "images" / "ui-timeline.png"
PARENT = ParentRef(agent="Assistant", name="user-42")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


class Timed:
    """A run's events at the moments given (ms after `origin`)."""

    def __init__(self, run_id: str, origin: int, parent: ParentRef = PARENT) -> None:
        self.run = RunEvents(run_id, parent)
        self.origin = origin
        self.events: list[ev.Event] = []

    def at(self, offset_ms: int, event: ev.Event) -> "Timed":
        self.events.append(msgspec.structs.replace(event, occurred_at=self.origin + offset_ms))
        return self


def scene(now: int) -> list[ev.Event]:
    t0 = now - 95_000
    runs: list[Timed] = []

    sources = Timed("research-quic", t0)
    r = sources.run
    sources.at(0, r.requested("Researcher", input={"query": "QUIC"},
                              parent_tool_call_id="call_research", display_order=0,
                              display="Research: QUIC")).at(40, r.started()).at(
        180, r.running()).at(2_400, r.milestone("sources-gathered", {"sources": 6})).at(
        5_100, r.output("QUIC is a transport over UDP with TLS 1.3 built in. ")).at(
        6_000, r.completed("QUIC: the six sources agree on the essentials.")).at(
        6_050, r.make(ev.RunFinishDelivered, status="completed", method=None,
                      message_id="hook-1"))
    runs.append(sources)

    live = Timed("research-http3", t0 + 300)
    r = live.run
    live.at(0, r.requested("Researcher", input={"query": "HTTP/3"},
                           parent_tool_call_id="call_research", display_order=1,
                           display="Research: HTTP/3")).at(60, r.started()).at(
        220, r.running()).at(2_000, r.milestone("sources-gathered", {"sources": 4})).at(
        4_000, r.output("HTTP/3 maps HTTP semantics onto QUIC streams; ")).at(
        90_000, r.progress(0.62, "3 of 5 sources"))
    runs.append(live)

    broken = Timed("research-sctp", t0 + 500)
    r = broken.run
    broken.at(0, r.requested("Researcher", input={"query": "SCTP"},
                             parent_tool_call_id="call_research", display_order=2,
                             display="Research: SCTP")).at(70, r.started()).at(
        250, r.running()).at(1_900, r.failed("search backend answered 503 three times"))
    runs.append(broken)

    coordinator = Timed("digest-1", t0 + 8_000)
    r = coordinator.run
    coordinator.at(0, r.requested("Coordinator", input={"parts": ["a", "b", "c"]},
                                  parent_tool_call_id="call_digest", display="Digest")).at(
        50, r.started()).at(200, r.running()).at(20_000, r.progress(2 / 3))
    runs.append(coordinator)
    nested_parent = ParentRef(agent="Coordinator",
                              name=nested_parent_name(PARENT.agent, PARENT.name, "digest-1"))
    for index, done in enumerate((True, True, False)):
        part = Timed(f"digest-1-part-{index}", t0 + 8_300 + index * 9_000, nested_parent)
        r = part.run
        part.at(0, r.requested("Summarizer", input={"text": "…"}, display_order=index,
                               display=f"Summarize part {index + 1}")).at(30, r.started()).at(
            120, r.running())
        if done:
            part.at(8_500, r.completed(f"Part {index + 1} in one line."))
        runs.append(part)

    importer = Timed("import-orders", t0 + 12_000)
    r = importer.run
    importer.at(0, r.requested("Importer", input={"rows": 120_000},
                               display="Import orders.csv",
                               detached=DetachedOptions(on_finish="on_import_done"),
                               max_budget_ms=4 * 3_600_000, no_progress_budget_ms=600_000)).at(
        80, r.started()).at(300, r.running()).at(
        40_000, r.milestone("half-imported", {"rows": 60_000})).at(
        80_000, r.progress(0.71, "85,200 of 120,000 rows"))
    runs.append(importer)

    publisher = Timed("publish-note", t0 + 30_000)
    r = publisher.run
    pending = [{"tool_call_id": "call_publish_1", "tool_name": "publish",
                "input": {"title": "HTTP/3 in one line"}, "reason": "approval"}]
    publisher.at(0, r.requested("Publisher", input={"input": "Write and publish a note"},
                                display="Publish a note")).at(40, r.started()).at(
        150, r.running()).at(3_000, r.milestone("needs-approval")).at(
        3_010, r.make(ev.RunPaused, reason="waiting_for_human", pending=pending))
    runs.append(publisher)

    stalled = Timed("sync-crm", t0 + 1_000)
    r = stalled.run
    stalled.at(0, r.requested("Importer", input={"rows": 5_000}, display="Sync CRM")).at(
        50, r.started()).at(180, r.running()).at(10_000, r.progress(0.2, "1,000 rows")).at(
        70_000, r.interrupted("no-progress", child_still_running=True))
    runs.append(stalled)
    return [event for run in runs for event in run.events]


async def main(output: Path) -> int:
    name = "shot" + uuid.uuid4().hex[:6]
    settings = Settings(nats_url=os.environ.get("TETHER_NATS_URL", "nats://127.0.0.1:4222"),
                        database_url=os.environ.get("TETHER_DATABASE_URL",
                                                    "postgresql://postgres@127.0.0.1:5432/tether"),
                        prefix=name, projection_schema=name)
    nc = await connect_nats(settings.nats_url, name="tether-ui-screenshot")
    pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=4)
    stop = asyncio.Event()
    try:
        await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings())
        async with pool.acquire() as conn:
            await migrate(conn, settings.projection_schema)
        log = EventLog(nc, settings.subjects)
        for event in scene(int(time.time() * 1000)):
            await log.append(event, expected_last_seq=None)
        projector = Projector(pool, log, settings.projection_schema)
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        tasks = [asyncio.create_task(projector.run(stop)),
                 asyncio.create_task(serve_ui(settings, stop, {}, host="127.0.0.1", port=0,
                                              started=started))]
        await asyncio.wait_for(projector.wait_for_position(await log.stream_last_seq()), 30)
        port = await asyncio.wait_for(started, 30)
        with tempfile.TemporaryDirectory() as profile:
            async with async_playwright() as playwright:
                context = await playwright.chromium.launch_persistent_context(
                    profile, executable_path="/usr/bin/chromium", headless=True,
                    args=CHROMIUM_ARGS, viewport={"width": 1200, "height": 1500},
                    device_scale_factor=1)
                page = await context.new_page()
                await page.goto(f"http://127.0.0.1:{port}/parents/{PARENT.agent}/{PARENT.name}")
                await page.wait_for_selector("#live[data-state=caught-up]")
                await page.wait_for_selector(".children .run")
                output.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(output), full_page=True)
                await context.close()
        stop.set()
        await asyncio.gather(*tasks)
        print(f"wrote {output}")
        return 0
    finally:
        stop.set()
        await remove_streams(nc.jetstream(), settings.subjects)
        await pool.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}" CASCADE')
        await pool.close()
        await nc.drain()


if __name__ == "__main__":
    arguments = argparse.ArgumentParser(description="Regenerate the UI's screenshot.")
    arguments.add_argument("output", nargs="?", type=Path, default=OUTPUT,
                           help=f"the PNG file to write (default: {OUTPUT})")
    sys.exit(asyncio.run(main(arguments.parse_args().output)))
