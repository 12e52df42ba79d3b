"""The `tether` command as a user runs it: against the real services, in a pipe and in a
pseudo-terminal of a given width (drawn by a terminal emulator), with every message the
user reads asserted."""

import asyncio
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import termios
import uuid
from pathlib import Path

import asyncpg
import pyte
import pytest

from tests.e2e.conftest import ServiceProcess
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams, remove_streams
from tether.client import connect
from tether.config import Settings
from tether.domain.events import ParentRef
from tether.testing import RunEvents

AGENTS = "examples.agents:Researcher,examples.agents:Sleeper"
ROOT = Path(__file__).resolve().parents[2]
TETHER_SCRIPT = Path(sys.executable).parent / "tether"


@pytest.fixture(scope="module")
def settings(nats_url: str, database_url: str) -> Settings:
    # One stack for the module: each test uses its own parent names.
    name = "t" + uuid.uuid4().hex[:10]
    return Settings(nats_url=nats_url, database_url=database_url, prefix=name,
                    projection_schema=name)


@pytest.fixture(scope="module")
def service_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env.update(TETHER_NATS_URL=settings.nats_url, TETHER_DATABASE_URL=settings.database_url,
               TETHER_PREFIX=settings.prefix, TETHER_PROJECTION_SCHEMA=settings.projection_schema,
               TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json", TETHER_AGENTS=AGENTS)
    return env


@pytest.fixture(scope="module")
async def stack(settings: Settings, service_env: dict[str, str]):
    started = [await ServiceProcess(name, service_env).start() for name in ("parent", "child-runner")]
    yield
    for service in started:
        await service.stop()
    nc = await connect_nats(settings.nats_url, name="tether-e2e")
    await remove_streams(nc.jetstream(), settings.subjects)
    await nc.drain()
    conn = await asyncpg.connect(settings.database_url)
    await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.projection_schema}" CASCADE')
    await conn.close()


async def tether_cli(env: dict, *args: str, stdin: bytes | None = None,
                     cwd: Path = ROOT) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=env, cwd=cwd,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(stdin), timeout=60)
    return process.returncode, out.decode(), err.decode()


class PseudoTerminal:
    """A pty of `columns` x `rows`; what the program writes is played on a pyte screen."""

    def __init__(self, columns: int, rows: int = 24) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = b""
        self.changed = asyncio.Event()
        asyncio.get_running_loop().add_reader(self.master, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the last writer closed the terminal
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.master)
            return
        self.raw += data
        self.stream.feed(data)
        self.changed.set()

    async def until(self, predicate, timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self.lines()):
                self.changed.clear()
                await self.changed.wait()

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display if line.strip()]

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.master)
        os.close(self.master)


def terminal_env(env: dict) -> dict:
    env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    # PYTHONFAULTHANDLER: a SIGABRT prints every thread's stack (`exit_after_interrupt`).
    return {**env, "TERM": "xterm-256color", "PYTHONFAULTHANDLER": "1"}


def as_a_foreground_job() -> None:
    """In the program's process, before it starts: Ctrl-C's signals at their defaults, as
    a shell sets them for the job in the foreground of a terminal. A suite started in the
    background by a script (`make test &`, nohup) would otherwise pass them on ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(ignored & 1 << (signal.SIGINT - 1))


async def exit_after_interrupt(process: asyncio.subprocess.Process, within: float = 10) -> int:
    """Ctrl-C, then the exit code. Its standard error is read meanwhile (a full pipe would
    stop it); one still running `within` seconds later is aborted, its threads' stacks on
    standard error, and the test fails with what it wrote there."""
    errors = asyncio.create_task(process.stderr.read())
    process.send_signal(signal.SIGINT)
    try:
        async with asyncio.timeout(within):
            return await process.wait()
    except TimeoutError:
        ignored = ignores_sigint(process.pid)
        process.send_signal(signal.SIGABRT)
        await process.wait()
        pytest.fail(f"still running {within:g} s after SIGINT (ignored: {ignored}); its "
                    "standard error:\n" + (await errors).decode(errors="replace"))
    finally:
        await errors


async def run_on_terminal(env: dict, columns: int, *args: str, stream: str = "stderr"):
    terminal = PseudoTerminal(columns)
    outputs = {"stdout": asyncio.subprocess.PIPE, "stderr": asyncio.subprocess.PIPE}
    outputs[stream] = terminal.slave
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=terminal_env(env), cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL, preexec_fn=as_a_foreground_job, **outputs)
    os.close(terminal.slave)
    return terminal, process


@pytest.mark.parametrize("columns", [60, 120, 200])
async def test_run_draws_one_line_that_fits_the_terminal_and_ends_on_the_final_status(
        stack, service_env, columns):
    terminal, process = await run_on_terminal(
        service_env, columns, "run", "Researcher", "--parent", "Assistant/cli",
        "--input", json.dumps({"query": "HTTP/3 and QUIC, " * 8, "pace_s": 0.15}))
    out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    await terminal.until(lambda lines: any("completed" in line for line in lines))
    terminal.close()
    result = json.loads(out)
    assert process.returncode == 0 and result["ok"] is True
    lines = terminal.lines()
    # One line for the run, redrawn in place: no stale frames left above it.
    assert len(lines) == 1, lines
    assert lines[0].startswith("Researcher completed"), lines
    assert "100%" in lines[0]
    # Every frame fitted: a frame wider than the terminal would have wrapped, and the
    # emulator would show its first rows left behind above the next frame.
    assert b"running" in terminal.raw, "the run was drawn while it ran"


async def test_run_piped_prints_each_change_once_and_the_final_status_last(stack, service_env):
    code, out, err = await tether_cli(
        service_env, "run", "Researcher", "--parent", "Assistant/cli",
        "--input", '{"query": "gRPC streaming"}')
    assert code == 0, err
    lines = err.splitlines()
    assert "\x1b" not in err, "no terminal codes into a pipe"
    assert len(lines) == len(set(lines)) and lines[-1].startswith("Researcher completed"), err
    result = json.loads(out)
    # The child returned a string (the summary) and streamed text: the text is the output.
    assert result["summary"] == "gRPC streaming: the two sources agree on the essentials."
    assert result["output"] == ("Searching the web for 'gRPC streaming'.\n"
                                "Two sources agree; writing the summary.\n")


async def test_watch_redraws_in_place_at_sixty_columns_until_interrupted(stack, service_env, settings):
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "watched")
        handles = [await me.run_agent_tool("Researcher", {"query": f"topic number {n} " * 6,
                                                          "pace_s": 0.1},
                                           run_id=f"watched-{n}", detached=True)
                   for n in range(3)]
    assert all(handle.status == "running" for handle in handles)
    terminal, process = await run_on_terminal(service_env, 60, "watch", "Assistant/watched",
                                              stream="stdout")
    await terminal.until(lambda lines: sum("completed" in line for line in lines) == 3)
    code = await exit_after_interrupt(process)
    terminal.close()
    lines = terminal.lines()
    assert code == 130
    assert len(lines) == 3 and all(line.startswith("Researcher completed") for line in lines), lines


async def test_ctrl_c_on_run_says_it_cancelled_the_run_and_does(stack, service_env, settings):
    terminal, process = await run_on_terminal(
        service_env, 100, "run", "Sleeper", "--parent", "Assistant/interrupted",
        "--run-id", "stopped", "--input", '{"seconds": 30}')
    await terminal.until(lambda lines: any("running" in line for line in lines))
    process.send_signal(signal.SIGINT)
    out, _ = await asyncio.wait_for(process.communicate(), timeout=15)
    await terminal.until(lambda lines: any("interrupted" in line for line in lines))
    terminal.close()
    assert (process.returncode, out) == (130, b"")
    assert any(line.startswith("tether run: interrupted; run stopped is cancelled")
               for line in terminal.lines()), terminal.lines()
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "interrupted")
        ended = await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="stopped",
                                        timeout=30)
    assert ended.status == "aborted", ended


async def test_input_from_a_file_and_from_stdin(stack, service_env, tmp_path):
    path = tmp_path / "input.json"
    path.write_text('{"query": "from a file"}')
    code, out, err = await tether_cli(service_env, "run", "Researcher", "--parent",
                                      "Assistant/cli", "--quiet", "--input", f"@{path}")
    assert code == 0, err
    assert json.loads(out)["summary"].startswith("from a file:")
    code, out, err = await tether_cli(service_env, "run", "Researcher", "--parent",
                                      "Assistant/cli", "--quiet", "--input", "-",
                                      stdin=b'{"query": "from stdin"}')
    assert code == 0, err
    assert json.loads(out)["summary"].startswith("from stdin:")


async def test_cancel_and_inspect_of_an_unknown_run_say_not_found(stack, service_env):
    for command in ("cancel", "inspect"):
        code, out, err = await tether_cli(service_env, command, "Assistant/cli", "nope")
        assert (code, out) == (1, "")
        assert err == (f"tether {command}: run nope not found: parent Assistant/cli has no "
                       "such run\n")


async def test_cancel_says_what_it_did(stack, service_env, settings):
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "cancelling")
        await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="long", detached=True)
        code, out, err = await tether_cli(service_env, "cancel", "Assistant/cancelling", "long")
        assert (code, err) == (0, "")
        assert out.startswith("cancel requested for run long (")
        await me.run_agent_tool("Researcher", {"query": "quick one"}, run_id="quick")
    code, out, _ = await tether_cli(service_env, "cancel", "Assistant/cancelling", "quick")
    assert (code, out) == (0, "run quick is already completed: nothing to cancel\n")


async def test_send_records_a_message_for_a_running_run_and_says_why_an_ended_one_refuses(
        stack, service_env, settings):
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "sending")
        await me.run_agent_tool("Sleeper", {"seconds": 30}, run_id="long", detached=True)
        code, out, err = await tether_cli(service_env, "send", "Assistant/sending", "long",
                                          "wrap up", "--data", '{"by": "noon"}',
                                          "--interrupt", "--id", "m1")
        assert (code, err) == (0, "")
        assert out == ("message m1 recorded for run long (interrupt): its child takes it in "
                       "at its next step\n")
        state = (await tether.read_run(me.ref, "long")).state
        (message,) = state.messages
        assert (message.text, message.data, message.mode) == ("wrap up", {"by": "noon"},
                                                              "interrupt")
        await me.cancel("long")
        await me.run_agent_tool("Researcher", {"query": "quick one"}, run_id="quick")
    code, out, err = await tether_cli(service_env, "send", "Assistant/sending", "quick", "hi")
    assert (code, out) == (1, "")
    assert err == ("tether send: run 'quick' is completed: a message goes to a starting or "
                   "running run\n")
    code, _, err = await tether_cli(service_env, "send", "Assistant/sending", "quick")
    assert (code, err) == (2, "tether send: give the message's text, --data, or both\n")


async def test_clear_prints_how_many_runs_it_cleared(stack, service_env, settings):
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "clearing")
        for n in range(2):
            await me.run_agent_tool("Researcher", {"query": "to be cleared"}, run_id=f"c{n}")
    code, out, err = await tether_cli(service_env, "clear", "Assistant/clearing",
                                      "--status", "completed")
    assert (code, out, err) == (0, "cleared 2 runs of Assistant/clearing\n", "")
    code, out, _ = await tether_cli(service_env, "clear", "Assistant/clearing")
    assert (code, out) == (0, "cleared 0 runs of Assistant/clearing: none matched\n")


async def test_oversized_input_is_refused_before_sending_with_the_limit_named(service_env):
    big = json.dumps({"query": "x" * 10_000_000}).encode()
    code, out, err = await tether_cli(service_env, "run", "Researcher", "--parent",
                                      "Assistant/cli", "--input", "-", stdin=big)
    assert (code, out) == (2, "")
    assert err == ("tether run: --input is 10,000,012 bytes; the limit is 262,144 bytes "
                   "(TETHER_MAX_INPUT_BYTES); nothing was sent\n")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_unreachable_servers_are_named_with_their_url(service_env):
    nats_url, pg_url = f"nats://127.0.0.1:{free_port()}", f"postgresql://u:pw@127.0.0.1:{free_port()}/db"
    env = {**service_env, "TETHER_NATS_URL": nats_url, "TETHER_DATABASE_URL": pg_url}
    code, _, err = await tether_cli(env, "inspect", "Assistant/cli", "r1")
    assert code == 1
    assert err.startswith(f"tether inspect: cannot connect to NATS at {nats_url} "
                          "(TETHER_NATS_URL or --nats-url): "), err
    code, _, err = await tether_cli(env, "projections", "migrate")
    assert code == 1
    assert err.startswith(f"tether: cannot connect to Postgres at postgresql://u:***@127.0.0.1:"
                          f"{pg_url.rsplit(':', 1)[1].split('/')[0]}/db (TETHER_DATABASE_URL or "
                          "--database-url): "), err
    assert "pw" not in err
    # A service whose NATS answers and whose Postgres does not names Postgres only, once
    # its start-up retries are over.
    code, _, err = await tether_cli({**env, "TETHER_NATS_URL": service_env["TETHER_NATS_URL"],
                                     "TETHER_STARTUP_TIMEOUT_MS": "1000"},
                                    "services", "parent")
    assert code == 1
    assert err.splitlines()[-1].startswith("tether: cannot connect to Postgres at "), err
    assert "NATS" not in err.splitlines()[-1]


async def test_a_busy_health_port_is_named(service_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**service_env, "TETHER_HEALTH_HOST": "127.0.0.1", "TETHER_HEALTH_PORT": str(port)}
        code, _, err = await tether_cli(env, "services", "parent")
    assert code == 1
    assert err.splitlines()[-1] == (
        f"tether: cannot serve health and metrics on 127.0.0.1:{port}: the port is in use "
        "(by another service?); set TETHER_HEALTH_PORT to a free port, or 0 for any")


async def test_the_tether_script_finds_agents_in_the_current_directory(service_env, tmp_path):
    (tmp_path / "my_agents.py").write_text(
        "from tether import ChildAgent\n\n"
        "class NotAnAgent:\n    pass\n")
    process = await asyncio.create_subprocess_exec(
        str(TETHER_SCRIPT), "services", "child-runner", "--agents", "my_agents:NotAnAgent",
        env=service_env, cwd=tmp_path, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 2
    # Imported from the current directory: what is wrong is the class, not the module.
    assert "agent 'my_agents:NotAnAgent': NotAnAgent is not a ChildAgent subclass in my_agents" \
        in err.decode()


async def test_global_flags_are_taken_after_the_command_too(stack, service_env, settings):
    """docs/operations.md: every command takes --nats-url, --prefix, ...; the environment
    here names a server nobody listens on, so only the flags reach the stack."""
    env = {**service_env, "TETHER_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "TETHER_PREFIX": "elsewhere"}
    code, out, err = await tether_cli(env, "inspect", "Assistant/cli", "nope",
                                      "--nats-url", settings.nats_url,
                                      "--prefix", settings.prefix)
    assert (code, out) == (1, "")
    assert err == "tether inspect: run nope not found: parent Assistant/cli has no such run\n"
    code, _, err = await tether_cli(env, "--prefix", settings.prefix, "inspect",
                                    "Assistant/cli", "nope", "--nats-url", settings.nats_url)
    assert code == 1 and "not found" in err, "a flag before the command is kept"


async def test_watch_at_eighty_columns_keeps_each_run_id_on_its_line(stack, service_env, settings):
    """A long message is cut to fit, never the run id."""
    run_ids = [f"research-with-a-rather-long-run-id-{n}" for n in range(2)]
    async with connect(settings=settings) as tether:
        me = tether.parent("Assistant", "narrow")
        for run_id in run_ids:
            await me.run_agent_tool("Sleeper", {"seconds": 30, "milestones": 3}, run_id=run_id,
                                    detached=True)
    terminal, process = await run_on_terminal(service_env, 80, "watch", "Assistant/narrow",
                                              stream="stdout")
    try:
        await terminal.until(lambda lines: len(lines) == 2 and all(
            "running" in line for line in lines))
        lines = terminal.lines()
        assert [line.rsplit("· ", 1)[-1] for line in lines] == run_ids, lines
        assert all(len(line) <= 80 for line in lines)
    finally:
        await exit_after_interrupt(process)
        terminal.close()
        async with connect(settings=settings) as tether:
            for run_id in run_ids:
                await tether.parent("Assistant", "narrow").cancel(run_id)


async def test_runs_show_and_diff_without_the_projections_name_the_schema(service_env):
    env = {**service_env, "TETHER_PROJECTION_SCHEMA": "nosuch"}
    for args in (["runs", "show", "r1", "--parent", "Assistant/cli"],
                 ["runs", "diff", "r1", "r2", "--parent", "Assistant/cli"]):
        code, out, err = await tether_cli(env, *args)
        assert (code, out) == (1, ""), err
        assert err == (f"tether {' '.join(args[:2])}: the projections are not in schema "
                       "'nosuch' (TETHER_PROJECTION_SCHEMA) of TETHER_DATABASE_URL: start the "
                       "projector (it creates them) or run `tether projections migrate`\n")


@pytest.fixture
async def unserved_env(service_env: dict[str, str]):
    """Streams of their own prefix, holding a completed run and a failed one of
    Assistant/cli, and no service running to take a command."""
    prefix = "u" + uuid.uuid4().hex[:10]
    subjects = Settings(prefix=prefix).subjects
    nc = await connect_nats(service_env["TETHER_NATS_URL"], name="tether-e2e")
    await ensure_streams(nc.jetstream(), subjects, StreamSettings())
    log = EventLog(nc, subjects)
    parent = ParentRef(agent="Assistant", name="cli")
    done, failed = RunEvents("done", parent), RunEvents("failed", parent)
    for event in (done.requested(), done.started(), done.completed(),
                  failed.requested(), failed.failed()):
        await log.append(event, expected_last_seq=None)
    yield {**service_env, "TETHER_PREFIX": prefix}
    await remove_streams(nc.jetstream(), subjects)
    await nc.drain()


@pytest.mark.parametrize("args", [["fork", "Assistant/cli", "done", "--at", "step:1"],
                                  ["rewind", "Assistant/cli", "failed"]])
async def test_a_detached_fork_or_rewind_with_no_parent_says_it_waits_and_expires(
        unserved_env, args):
    code, out, err = await tether_cli(unserved_env, "runs", *args, "--detached",
                                      "--expires-in", "1")
    assert code == 1, (out, err)
    lines = err.splitlines()
    assert lines[0].startswith(f"tether runs {args[0]}: waiting: run "), err
    assert "for at most 1s" in lines[0] and "no parent service answers" in lines[0], err
    assert len(lines) == 1, err
    assert json.loads(out)["error"] == ("the run request expired: no parent service took it "
                                        "within 1s (its expires_in), so none will apply it"), out


async def test_send_with_no_parent_says_at_once_that_it_waits_and_ends_when_it_expires(
        unserved_env):
    code, out, err = await tether_cli(unserved_env, "send", "Assistant/cli", "failed", "hi",
                                      "--id", "m1", "--expires-in", "3")
    assert (code, out) == (1, ""), err
    waiting, *rest = err.splitlines()
    assert waiting.startswith("tether send: waiting: message 'm1' for run 'failed' is stored "
                              "and waits for at most 3s (its expires_in); no parent service "
                              "answers "), err
    assert rest == [("tether send: message 'm1' for run 'failed' expired: no parent service "
                     "recorded it within 3s (its expires_in), so none will")], err
