"""`tether ui` in a real browser: headless Chromium (Debian's `chromium` package) driven by
Playwright, against the parent, a child-runner, the projector and the UI as processes.

Every wait is on a page condition (Playwright's `expect` / `wait_for_function`), never a
fixed sleep. No Chromium is a failure, not a skip: `.ci/run` installs it.
"""

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import quote

import asyncpg
import pytest
from playwright.async_api import Page, expect
from service_processes import support_path

from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.client import Tether, connect
from tether.config import Settings
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef, RunCancelRequested, RunRunning
from tether.domain.ids import nested_parent_name
from tether.testing import RunEvents

AGENTS = ("examples.agents:Sleeper,examples.agents:Researcher,examples.model_agents:Publisher,"
          "ui_tree_agents:Chief,ui_tree_agents:Lead,ui_tree_agents:Clerk,"
          "ui_progress_agents:Halfway,ui_fork_agents:Stepper")
PARENT = ("Assistant", "user-42")


async def ready(service, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while True:
            reader, writer = await asyncio.open_connection("127.0.0.1", service.health_port)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await reader.readline()
            writer.close()
            if int(head.split()[1]) == 200:
                return
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def stack_settings(nats_url: str, database_url: str) -> Settings:
    name = "t" + uuid.uuid4().hex[:10]
    return Settings(nats_url=nats_url, database_url=database_url, prefix=name,
                    projection_schema=name)


@pytest.fixture(scope="module")
async def ui_url(stack_settings, service_process) -> AsyncIterator[str]:
    """The parent, a child-runner, the projector and the UI, for every test of the module
    (each uses run ids of its own); the UI's base URL."""
    settings = stack_settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(TETHER_NATS_URL=settings.nats_url, TETHER_DATABASE_URL=settings.database_url,
               TETHER_PREFIX=settings.prefix, TETHER_PROJECTION_SCHEMA=settings.projection_schema,
               TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json",
               PYTHONPATH=support_path(env.get("PYTHONPATH") or ""))
    nc = await connect_nats(settings.nats_url, name="tether-ui-tests")
    await ensure_streams(nc.jetstream(), settings.subjects, StreamSettings())
    processes = [service_process("parent", {**env, "TETHER_AGENTS": AGENTS}),
                 service_process("projector", env),
                 service_process("child-runner", {**env, "TETHER_AGENTS": AGENTS,
                                                  "TETHER_RUNNER_CONCURRENCY": "16"}),
                 service_process("ui", {**env, "TETHER_UI_PORT": "0"})]
    try:
        await asyncio.gather(*(process.start() for process in processes))
        await asyncio.gather(*(ready(process) for process in processes))
        [listening] = await processes[-1].logged("ui.listening")
        yield f"http://127.0.0.1:{listening['port']}"
    finally:
        for process in processes:
            await process.stop()
            print(f"--- {process.name} (last 100 log lines) ---")  # shown when a test failed
            for line in process.lines[-100:]:
                print(json.dumps(line))
        await remove_streams(nc.jetstream(), settings.subjects)
        await nc.drain()
        connection = await asyncpg.connect(settings.database_url)
        await connection.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}" CASCADE')
        await connection.close()


@pytest.fixture
async def tether(ui_url, stack_settings) -> AsyncIterator[Tether]:
    async with connect(settings=stack_settings) as client:
        yield client


def run_card(page: Page, run_id: str):
    return page.locator(f'#timeline > .group > .run[data-run-id="{run_id}"]')


async def open_timeline(page: Page, ui_url: str) -> None:
    await page.goto(f"{ui_url}/parents/{PARENT[0]}/{PARENT[1]}")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")


async def test_the_index_lists_the_parent_and_searches(page, ui_url, tether):
    await tether.parent("Assistant", "searched").run_agent_tool("Sleeper", {"seconds": 0},
                                                                run_id="quick")
    await page.goto(ui_url)
    row = page.locator('tr.parent[data-parent="Assistant/searched"]')
    await expect(row).to_be_visible()
    await expect(row.locator('[data-status="completed"]')).to_have_text("1")
    await page.fill("#search", "nobody")
    await expect(row).to_be_hidden()
    await page.fill("#search", "SEARCH")
    await row.locator("a").click()
    await expect(page.locator("body")).to_have_attribute("data-page", "parent")
    await expect(run_card(page, "quick")).to_have_attribute("data-status", "completed")


async def test_a_live_run_advances_its_bar_passes_its_milestones_in_order_and_completes(
        page, ui_url, tether):
    await open_timeline(page, ui_url)
    handle = await tether.parent(*PARENT).run_agent_tool(
        "Sleeper", {"seconds": 2.5, "milestones": 5}, run_id="nap", detached=True)
    assert handle.status == "running"
    card = run_card(page, "nap")
    await expect(card).to_have_attribute("data-status", "running")
    # Part of the way: the bar shows a fraction strictly between 0 and 1.
    await page.wait_for_function(
        """() => { const bar = document.querySelector('#timeline .run[data-run-id="nap"] .bar');
                   const f = bar && parseFloat(bar.dataset.fraction);
                   return f > 0 && f < 1; }""", polling="raf")
    await expect(card).to_have_attribute("data-status", "completed", timeout=20_000)
    await expect(card.locator(".bar")).to_have_attribute("data-fraction", "1")
    await expect(card.locator(".pin")).to_have_text(
        ["step-1", "step-2", "step-3", "step-4", "step-5"])
    assert [await pin.get_attribute("data-sequence") for pin in
            await card.locator(".pin").all()] == ["0", "1", "2", "3", "4"]
    await expect(card.locator(".summary")).to_have_text("slept 2.5s")


async def test_the_cancel_button_ends_a_run_aborted(page, ui_url, tether):
    await open_timeline(page, ui_url)
    await tether.parent(*PARENT).run_agent_tool("Sleeper", {"seconds": 120}, run_id="long",
                                                detached=True)
    card = run_card(page, "long")
    await expect(card).to_have_attribute("data-status", "running")
    await card.locator("button.cancel").click()
    await expect(page.locator("#notice")).to_have_text("cancel requested for long")
    await expect(card).to_have_attribute("data-status", "aborted")
    await expect(card.locator("button.cancel")).to_have_count(0)


async def test_an_approval_from_the_inbox_resumes_a_paused_run(page, ui_url, tether):
    await open_timeline(page, ui_url)
    await tether.parent(*PARENT).run_agent_tool(
        "Publisher", {"input": "Write a note about HTTP/3 and publish it."}, run_id="pub",
        detached=True)
    item = page.locator('#inbox .item[data-run-id="pub"]')
    await expect(item.locator(".pending b")).to_have_text("publish")
    await expect(run_card(page, "pub")).to_have_attribute("data-waiting", "waiting_for_human")
    await item.locator("button.approve").click()
    await expect(run_card(page, "pub")).to_have_attribute("data-status", "completed")
    await expect(run_card(page, "pub").locator(".summary")).to_have_text(
        "Published: https://notes.example/pub")
    await expect(page.locator("#inbox-section")).to_be_hidden()

    # The model child's page: its steps with their tool calls, and its usage and cost.
    await run_card(page, "pub").locator("a.id").click()
    await expect(page.locator("body")).to_have_attribute("data-page", "run")
    await expect(page.locator("#steps tr.step")).to_have_count(4)
    await expect(page.locator("#steps")).to_contain_text("publish [approved]")
    await expect(page.locator("#usage")).to_contain_text("cost $")


async def test_a_grandchilds_pause_shows_its_path_on_the_root_and_is_answered_there(
        page, ui_url, tether):
    await open_timeline(page, ui_url)
    await tether.parent(*PARENT).run_agent_tool("Chief", {"input": "lease"}, run_id="tree",
                                                detached=True)
    card = run_card(page, "tree")
    await expect(card).to_have_attribute("data-waiting", "waiting_for_human")
    hops = card.locator(":scope > .waiting-path .hop")
    await expect(hops).to_have_text(["Lead agent-tool:call_0_0", "Clerk agent-tool:call_0_0"])
    chief = nested_parent_name(*PARENT, "tree")
    lead = nested_parent_name("Chief", chief, "agent-tool:call_0_0")
    assert [await hop.get_attribute("href") for hop in await hops.all()] == [
        f"/runs/Chief/{quote(chief, safe='')}/agent-tool%3Acall_0_0",
        f"/runs/Lead/{quote(lead, safe='')}/agent-tool%3Acall_0_0"]
    # The inbox answers the paused grandchild from the root's timeline.
    item = page.locator('#inbox .item[data-run-id="tree"]')
    await expect(item.locator(".pending b")).to_have_text("sign")
    await expect(item).to_contain_text("Clerk agent-tool:call_0_0 below")
    await item.locator("button.approve").click()
    await expect(page.locator("#notice")).to_have_text("answered agent-tool:call_0_0")
    await expect(card).to_have_attribute("data-status", "completed")
    await expect(card.locator(":scope > .summary")).to_have_text("All done.")
    await expect(card.locator(":scope > .waiting-path")).to_have_count(0)
    # The hop's link opens the paused run's own page.
    await page.goto(f"{ui_url}/runs/Lead/{quote(lead, safe='')}/agent-tool%3Acall_0_0")
    await expect(page.locator("#steps")).to_contain_text("sign [approved]")


async def test_the_sequence_slider_shows_an_earlier_state(page, ui_url, tether):
    await tether.parent(*PARENT).run_agent_tool("Researcher", {"query": "HTTP/3"},
                                                run_id="research")
    await page.goto(f"{ui_url}/runs/{PARENT[0]}/{PARENT[1]}/research")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    await expect(page.locator("#current .run")).to_have_attribute("data-status", "completed")
    await expect(page.locator("#as-of .run")).to_have_attribute("data-status", "completed")
    types = await page.locator("#events tbody tr td:nth-child(2)").all_text_contents()
    running = types.index("run.running")
    slider = page.locator("#slider")
    await slider.fill(str(running))
    await expect(page.locator("#as-of .run")).to_have_attribute("data-status", "running")
    await expect(page.locator("#slider-seq")).to_contain_text("run.running")
    await expect(page.locator("#as-of .summary")).to_have_count(0)
    await expect(page.locator("#events tr.past").first).to_be_attached()
    await slider.fill("0")
    await expect(page.locator("#as-of .run")).to_have_attribute("data-status", "starting")


async def compare_with_a_fork_at_its_second_step(page: Page, ui_url: str, run_id: str) -> str:
    """On a completed `Stepper` run's page, fork it at its second recorded step with the
    slider, then open the comparison the page links; the fork point's sequence."""
    await page.goto(f"{ui_url}/runs/{PARENT[0]}/{PARENT[1]}/{run_id}")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    await expect(page.locator("#current .run")).to_have_attribute("data-status", "completed")
    rows = page.locator("#events tbody tr")
    types = await page.locator("#events tbody tr td:nth-child(2)").all_text_contents()
    second_step = [i for i, kind in enumerate(types) if kind == "run.step_recorded"][1]
    seq = await rows.nth(second_step).get_attribute("data-seq")
    await page.locator("#slider").fill(str(second_step))
    await expect(page.locator("#as-of")).to_have_attribute("data-seq", seq)

    await page.get_by_role("button", name="Fork here").click()

    await expect(page.locator("#notice")).to_contain_text(f"forked {run_id} at seq:{seq}")
    await page.locator("#forked a.compare").click()
    await expect(page.locator("body")).to_have_attribute("data-page", "diff")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    return seq


async def test_forking_at_the_sliders_sequence_makes_a_sibling_shown_beside_it(
        page, ui_url, tether):
    await tether.parent(*PARENT).run_agent_tool("Stepper", {}, run_id="stepped")
    seq = await compare_with_a_fork_at_its_second_step(page, ui_url, "stepped")
    # Steps 0 and 1 were reused; step 2 is each run's own.
    await expect(page.locator("#parted")).to_have_text(
        "the same for the first 2 steps; they part at step 2")
    await expect(page.locator(".steps-diff tbody tr.differs")).to_have_count(1)
    await expect(page.locator(".side").nth(1).locator(".summary")).to_contain_text(
        "the last by stepped:fork-")
    await open_timeline(page, ui_url)
    fork_card = page.locator('#timeline .run:has(.fork)')
    await expect(fork_card.locator(".fork")).to_contain_text(f"fork of stepped at seq:{seq}")
    await expect(fork_card).to_have_attribute("data-status", "completed")


async def test_the_comparison_with_a_fork_still_going_follows_it_to_its_end(
        page, ui_url, tether, tmp_path):
    hold = tmp_path / "hold"
    await tether.parent(*PARENT).run_agent_tool("Stepper", {"hold_while": str(hold)},
                                                run_id="stepped-held")
    hold.touch()  # the fork's own step waits until the comparison is on the screen
    await compare_with_a_fork_at_its_second_step(page, ui_url, "stepped-held")
    fork_side = page.locator(".side").nth(1)
    await expect(fork_side.locator(".status")).to_have_text("running")
    await expect(page.locator("#parted")).to_have_text("the same for the first 2 steps")

    hold.unlink()  # the page is not loaded again: what it shows follows the fork

    await expect(fork_side.locator(".status")).to_have_text("completed")
    await expect(page.locator("#parted")).to_have_text(
        "the same for the first 2 steps; they part at step 2")
    await expect(fork_side.locator(".summary")).to_contain_text("the last by stepped-held:fork-")


async def test_an_unknown_run_page_is_a_404_page(page, ui_url):
    answer = await page.goto(f"{ui_url}/runs/{PARENT[0]}/{PARENT[1]}/nobody")
    assert answer.status == 404
    await expect(page.locator("h1")).to_have_text("Not found")


async def test_clearing_finished_runs_takes_them_off_the_timeline(page, ui_url, tether):
    me = tether.parent("Assistant", "clearing")
    await me.run_agent_tool("Sleeper", {"seconds": 0}, run_id="done-1")
    await me.run_agent_tool("Sleeper", {"seconds": 120}, run_id="still-going", detached=True)
    await page.goto(f"{ui_url}/parents/Assistant/clearing")
    cards = page.locator("#timeline .group > .run")
    await expect(page.locator('#timeline .run[data-run-id="still-going"]')).to_have_attribute(
        "data-status", "running")
    await expect(cards).to_have_count(2)
    await page.click("#clear-finished")
    await expect(page.locator("#notice")).to_contain_text("clear requested for Assistant/clearing")
    await expect(cards).to_have_count(1)
    await expect(cards).to_have_attribute("data-run-id", "still-going")
    await me.cancel("still-going")


async def test_re_requesting_an_interrupted_run_re_attaches_to_it(page, ui_url, tether):
    run = RunEvents("stalled", ParentRef(agent=PARENT[0], name=PARENT[1]),
                    start_ms=int(time.time() * 1000))
    await tether.log.append_batch(
        [run.requested("Sleeper", input={"seconds": 1}), run.started(), run.running(),
         run.interrupted("no-progress", child_still_running=False)], expected_last_seq=0)
    await open_timeline(page, ui_url)
    card = run_card(page, "stalled")
    await expect(card).to_have_attribute("data-status", "interrupted")
    await expect(card.locator(".reason")).to_contain_text("reason: no-progress")
    await expect(card.locator(".reason")).to_contain_text("child still running: false")
    await card.locator("button.rerequest").click()
    await expect(page.locator("#notice")).to_have_text("re-requested stalled")
    await expect(card.locator("div.meta")).to_contain_text("re-attach 1")


async def test_a_run_given_up_by_its_budget_offers_no_re_request(page, ui_url, tether):
    """Its cancel is in its log: a re-attached child would be stopped at once."""
    run = RunEvents("spent", ParentRef(agent=PARENT[0], name=PARENT[1]),
                    start_ms=int(time.time() * 1000))
    await tether.log.append_batch(
        [run.requested("Sleeper", input={"seconds": 1}), run.started(),
         run.make(RunRunning, attempt=1, runner_id="runner-1", agent_version="v7"),
         run.make(RunCancelRequested, reason="give-up"),
         run.interrupted("budget-exceeded", child_still_running=True)], expected_last_seq=0)
    await open_timeline(page, ui_url)
    card = run_card(page, "spent")
    await expect(card).to_have_attribute("data-status", "interrupted")
    await expect(card.locator(".reason")).to_contain_text("reason: budget-exceeded")
    await expect(card.locator("button.rerequest")).to_have_count(0)
    await expect(card.locator("div.meta .version")).to_have_text("version v7")
    await page.goto(f"{ui_url}/runs/{PARENT[0]}/{PARENT[1]}/spent")
    await expect(page.locator("#current")).to_contain_text("budget-exceeded")
    await expect(page.locator("button.rerequest")).to_have_count(0)


async def expect_done(run) -> None:
    bar = run.locator(":scope > .bar")
    await expect(bar).to_have_attribute("data-fraction", "1")
    await expect(bar).to_have_attribute("aria-valuenow", "100")
    await expect(run.locator(":scope > .meta .percent")).to_have_text("100 %")
    assert await bar.evaluate("bar => bar.firstElementChild.style.width") == "100%"


async def test_a_completed_run_reads_100_percent_whatever_it_last_reported(
        page, ui_url, tether):
    await open_timeline(page, ui_url)
    await tether.parent(*PARENT).run_agent_tool("Halfway", {}, run_id="halfway")
    run_path = f"{PARENT[0]}/{PARENT[1]}/halfway"
    reported = (await (await page.request.get(f"{ui_url}/api/runs/{run_path}")).json())["run"]
    assert (reported["status"], reported["progress"]["fraction"]) == ("completed", 0.5)
    card = run_card(page, "halfway")
    await expect(card).to_have_attribute("data-status", "completed")
    await expect_done(card)
    await page.goto(f"{ui_url}/runs/{run_path}")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    await expect_done(page.locator("#current > .run"))


async def test_a_runs_budgets_read_in_hours(page, ui_url, tether):
    run = RunEvents("budgeted", ParentRef(agent=PARENT[0], name=PARENT[1]),
                    start_ms=int(time.time() * 1000))
    await tether.log.append_batch(
        [run.requested("Importer", input={"rows": 120_000},
                       detached=DetachedOptions(on_finish="on_import_done"),
                       max_budget_ms=7_200_000, no_progress_budget_ms=86_400_000),
         run.started(), run.running(), run.progress(0.1, "12,000 rows")], expected_last_seq=0)
    answer = await page.request.get(f"{ui_url}/api/runs/{PARENT[0]}/{PARENT[1]}/budgeted")
    requested_at = (await answer.json())["run"]["max_budget_deadline"] - 7_200_000
    # The page's clock, set by the test: at the request (on the broker's clock, as the
    # deadlines), then an hour and a half later.
    await page.add_init_script(f"window.testNow = {requested_at}; Date.now = () => window.testNow;")
    await open_timeline(page, ui_url)
    deadline = run_card(page, "budgeted").locator(".deadline")
    await expect(deadline).to_have_text("budget 2 h left · no-progress 24 h left")
    await page.evaluate(f"window.testNow = {requested_at + 5_400_000}")
    await expect(deadline).to_have_text("budget 30 min left · no-progress 22 h 30 min left")


LONG = {"document": "x" * 4_000, "url": "https://example.com/" + "segment/" * 400}


@pytest.mark.parametrize("width", [1280, 1024])
async def test_long_event_data_wraps_inside_the_page(page, ui_url, tether, width):
    run = RunEvents(f"long-{width}", ParentRef(agent=PARENT[0], name=PARENT[1]),
                    start_ms=int(time.time() * 1000))
    await tether.log.append_batch(
        [run.requested("Importer", input=LONG, display="Import " + "y" * 200), run.started(),
         run.running(), run.output("o" * 3_000),
         run.completed(summary="s" * 2_000, output={"rows": ["r" * 2_000]})],
        expected_last_seq=0)
    await page.set_viewport_size({"width": width, "height": 800})
    overflow = """() => [document.documentElement.scrollWidth,
                         document.documentElement.clientWidth]"""
    await page.goto(f"{ui_url}/runs/{PARENT[0]}/{PARENT[1]}/long-{width}")
    await expect(page.locator("#events tbody tr")).to_have_count(5)
    scrolled, shown = await page.evaluate(overflow)
    assert scrolled <= shown, f"the run's page is {scrolled} px wide in a {shown} px window"
    # Wrapped, not cut: the whole payload is on the page.
    requested = page.locator("#events tbody tr").first.locator("pre.json")
    assert LONG["document"] in await requested.text_content()
    await open_timeline(page, ui_url)
    await expect(run_card(page, f"long-{width}")).to_have_attribute("data-status", "completed")
    scrolled, shown = await page.evaluate(overflow)
    assert scrolled <= shown, f"the timeline is {scrolled} px wide in a {shown} px window"


async def test_a_message_of_the_log_no_run_can_take_is_named_on_the_page(page, ui_url, tether):
    """Published raw on a run's subject (a buggy client, a hand-run `nats pub`): no run
    shows it, and the page says it was there rather than leave a gap."""
    parent = ParentRef(agent="Assistant", name="unreadable")
    await tether.parent(parent.agent, parent.name).run_agent_tool("Sleeper", {"seconds": 0},
                                                                    run_id="fine")
    await page.goto(f"{ui_url}/parents/{parent.agent}/{parent.name}")
    await expect(page.locator("body")).to_have_attribute("data-loaded", "true")
    ack = await tether.js.publish(tether.subjects.run_events(parent, "fine"), b"not json")
    await expect(page.locator("#notice")).to_have_text(
        f"event at seq {ack.seq} could not be read: not JSON: Expecting value: line 1 "
        "column 1 (char 0)")
    await expect(run_card(page, "fine")).to_have_attribute("data-status", "completed")
