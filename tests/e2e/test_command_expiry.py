"""Commands sent while no parent service runs: the sender is told that nobody serves
them, and a command past its expiry is not applied by a parent that starts later, while
one without an expiry still is. Real services as processes, the CLI as a user runs it."""

import asyncio
import json

from skewed_clock import faketime_env

from tests.e2e.test_cli import run_on_terminal, tether_cli
from tether.client import connect

AGENTS = "examples.agents:Researcher"


async def test_the_cli_says_nobody_serves_its_run_and_ends_it_when_it_expires(log, service_env):
    """Streams exist (`log`), no parent service runs."""
    code, out, err = await tether_cli(
        service_env, "run", "Researcher", "--parent", "Assistant/late", "--run-id", "late-1",
        "--input", '{"query": "QUIC"}', "--expires-in", "1")

    assert code == 1, err
    result = json.loads(out)
    assert result["ok"] is False and result["status"] == "error"
    assert "no parent service took it within 1s" in result["error"]
    [waiting] = [line for line in err.splitlines() if "waiting:" in line]
    assert "run late-1: the request is stored and waits for at most 1s" in waiting
    assert "no parent service answers" in waiting and "tether services parent" in waiting


async def test_on_a_terminal_the_waiting_line_is_drawn_whole(log, service_env):
    terminal, process = await run_on_terminal(
        service_env, 100, "run", "Researcher", "--parent", "Assistant/late",
        "--run-id", "late-2", "--input", '{"query": "QUIC"}', "--expires-in", "1")
    out, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    terminal.close()
    assert process.returncode == 1 and json.loads(out)["ok"] is False
    lines = terminal.lines()
    assert lines[0].startswith("tether run: waiting: run late-2: the request is stored"), lines
    # Wrapped to the terminal's width (the run has no line: it is not in the log).
    assert "no parent service answers" in " ".join(lines), lines


async def test_a_parent_started_later_applies_no_expired_command(log, settings, services):
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "late")
        parent = await services("parent", TETHER_AGENTS=AGENTS)
        runner = await services("child-runner", TETHER_AGENTS=AGENTS)
        before = await me.run_agent_tool("Researcher", {"query": "kept"}, run_id="before")
        assert before.ok
        await parent.stop()

        # While no parent runs: a clear and a run request that expire in a second, and a
        # run request without an expiry. The expiring request's caller is answered once
        # it has expired (no parent took it); the other waits for a parent.
        told: list[str] = []
        await me.clear(expires_in=1)
        expired = await me.run_agent_tool("Researcher", {"query": "stale"}, run_id="stale",
                                          detached=True, expires_in=1, on_waiting=told.append)
        waiting = asyncio.create_task(
            me.run_agent_tool("Researcher", {"query": "queued"}, run_id="queued"))

        assert expired.status == "error" and "no parent service took it" in expired.error
        assert len(told) == 1 and "no parent service answers" in told[0]
        assert not waiting.done()

        parent = await services("parent", TETHER_AGENTS=AGENTS)
        queued = await asyncio.wait_for(waiting, timeout=30)
        assert queued.ok, queued

        [clear] = await parent.logged("command.expired")
        assert clear["kind"] == "clear" and clear["overdue_ms"] > 0
        assert (await me.inspect("before")).status == "completed", "the clear was applied"
        [rejected] = [stored.event for stored in await log.read_subject(
            log.subjects.run_events(me.ref, "stale"))]
        assert rejected.type == "run.rejected" and rejected.data.code == "expired"
        assert "longer than its expires_in_ms (1000)" in rejected.data.error
        assert not any(line.get("run_id") == "stale" for line in runner.lines)

        # A command without an expiry is written without the field: a parent from
        # before expiries refuses fields it does not know.
        stored = await log.jetstream.get_last_msg(settings.subjects.commands_stream,
                                                  settings.subjects.command_for("run", me.ref))
        assert json.loads(stored.data)["run_id"] == "queued"
        assert "expires_in_ms" not in json.loads(stored.data)


async def test_a_parent_whose_clock_is_a_minute_ahead_applies_a_command_within_its_expiry(
        log, settings, services):
    """Its expiry is counted on the broker's clock: the parent's own wall clock, 60 s
    ahead, would take a run request sent a moment ago as 60 s old."""
    await services("parent", TETHER_AGENTS=AGENTS, **faketime_env("+60s"))
    await services("child-runner", TETHER_AGENTS=AGENTS)
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "skewed")
        result = await me.run_agent_tool("Researcher", {"query": "in time"}, run_id="fresh",
                                         expires_in=30, timeout=30)
    assert result.ok, result
