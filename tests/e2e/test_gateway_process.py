"""`tether gateway` as a process, as docs/interop.md and the demo's last lines run it: with
the interop example's callers file, beside the parent service and a child-runner (processes
too), it turns ready, lets the example MCP client (examples/interop/mcp_client.py, run as
printed) list the Researcher and call it, a durable run of the caller's parent; it refuses
a request without a caller's token (401), and a SIGTERM ends it promptly and cleanly.
Without a callers file it does not start: it exits 2 at once, naming the setting."""

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_processes import ServiceProcess, ready

from tether.asgi_serving import GRACEFUL_SHUTDOWN_S
from tether.domain.events import ParentRef

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "examples.agents:Researcher"
CALLERS_FILE = ROOT / "examples" / "interop" / "callers.toml"
CLIENT = ROOT / "examples" / "interop" / "mcp_client.py"
REMOTE = "examples.interop.remote_children"
TOKEN = "demo-token"  # the one caller of CALLERS_FILE, "demo"
CALLER_PARENT = ParentRef(agent="Gateway", name="demo")  # its parent: the default agent
EXIT_WITHIN_S = 10.0


class GatewayProcess(ServiceProcess):
    """`tether gateway ARGS...` in a child process, its JSON log lines collected."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        super().__init__("gateway", env)
        self.args = args

    async def start(self) -> "GatewayProcess":
        await self._spawn(sys.executable, "-m", "tether.cli", "gateway", *self.args)
        await asyncio.wait_for(self._started.wait(), timeout=30)
        return self


async def test_the_example_mcp_client_calls_the_researcher_through_tether_gateway(
        log, pool, services, service_env, devstack):
    # `log` and `pool` remove the streams and the schema of this test's prefix afterwards.
    parent, runner = await asyncio.gather(services("parent", TETHER_AGENTS=AGENTS),
                                          services("child-runner", TETHER_AGENTS=AGENTS))
    port, health_port = devstack.free_port(), devstack.free_port()
    gateway = GatewayProcess({**service_env, "TETHER_GATEWAY_CALLERS_FILE": str(CALLERS_FILE),
                              "TETHER_GATEWAY_PORT": str(port),
                              "TETHER_HEALTH_PORT": str(health_port)}, "--agents", AGENTS)
    try:
        await gateway.start()
        assert gateway.health_port == health_port
        await asyncio.gather(ready(parent), ready(runner), ready(gateway))
        [listening] = await gateway.logged("gateway.listening")
        mcp_url = f"http://127.0.0.1:{port}/mcp"
        assert (listening["port"], listening["mcp"]) == (port, mcp_url)
        assert listening["agents"] == ["Researcher"] and listening["callers"] == 1

        # Only a caller of the callers file gets past the door; /healthz is open.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert (await http.get("/healthz")).status_code == 200
            ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            for headers in ({}, {"Authorization": "Bearer not-demo-token"},
                            {"Authorization": f"Basic {TOKEN}"}):
                refused = await http.post("/mcp", json=ping, headers=headers)
                assert refused.status_code == 401, (headers, refused.text)
                assert refused.json()["error"] == "invalid_token"
                assert refused.headers["www-authenticate"].startswith("Bearer")

        # The example client, as the demo prints it (with this gateway's URL).
        client = await asyncio.create_subprocess_exec(
            sys.executable, str(CLIENT), "--url", mcp_url, "--token", TOKEN, "HTTP/3",
            cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(client.communicate(), timeout=30)
        text = out.decode()
        assert client.returncode == 0, (text, err.decode())
        lines = text.splitlines()
        assert lines[0] == "tools: Researcher", text
        run_id, summary = lines[-1].removeprefix("run ").split(": ", 1)
        assert summary == "HTTP/3: the two sources agree on the essentials.", text
        # The call was a Tether run of the caller's parent, completed in the log.
        run = await log.read_run(CALLER_PARENT, run_id)
        assert [event.type for event in run.events][-1] == "run.completed", run.events

        gateway.signal(signal.SIGTERM)
        stopping = time.monotonic()
        code = await gateway.wait(timeout=EXIT_WITHIN_S)
        took = time.monotonic() - stopping
        assert code == 0 and took < GRACEFUL_SHUTDOWN_S / 2, (code, took)
        assert gateway.lines[-1]["event"] == "service.stopped", gateway.lines[-5:]
        assert not [line for line in gateway.lines if line.get("level") == "error"]
    finally:
        await gateway.stop()


async def test_the_remote_children_example_calls_the_gateway_back_over_a2a_and_mcp(
        log, pool, services, service_env, devstack):
    """examples/interop/remote_children.py as its docstring runs it: the Researcher the
    gateway serves is a remote child of this Tether, over each protocol."""
    port, health_port = devstack.free_port(), devstack.free_port()
    env = {"TETHER_AGENTS": f"{AGENTS},{REMOTE}:RemoteResearcher,{REMOTE}:ResearchTool",
           "GATEWAY_TOKEN": TOKEN, "GATEWAY_URL": f"http://127.0.0.1:{port}"}
    parent, runner = await asyncio.gather(services("parent", **env),
                                          services("child-runner", **env))
    gateway = GatewayProcess({**service_env, "TETHER_GATEWAY_CALLERS_FILE": str(CALLERS_FILE),
                              "TETHER_GATEWAY_PORT": str(port),
                              "TETHER_HEALTH_PORT": str(health_port)}, "--agents", AGENTS)
    try:
        await gateway.start()
        await asyncio.gather(ready(parent), ready(runner), ready(gateway))
        for agent_type in ("RemoteResearcher", "ResearchTool"):
            run = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tether.cli", "run", agent_type, "--parent", "Assistant/me",
                "--input", '{"query": "HTTP/3"}', "--quiet", cwd=ROOT,
                env={**service_env, **env}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(run.communicate(), timeout=60)
            assert run.returncode == 0, (agent_type, out.decode(), err.decode())
            result = json.loads(out)
            assert result["ok"] is True, result
            assert result["summary"] == "HTTP/3: the two sources agree on the essentials.", result
    finally:
        await gateway.stop()


@pytest.mark.parametrize("command", [["gateway", "--agents", AGENTS],
                                     ["services", "gateway", "--agents", AGENTS]])
async def test_without_a_callers_file_the_gateway_exits_2_at_once_naming_the_setting(
        service_env, devstack, command):
    """It stops before it connects to anything: a NATS nobody serves is never waited on."""
    env = {**service_env, "TETHER_NATS_URL": f"nats://127.0.0.1:{devstack.free_port()}"}
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *command, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 2, err.decode()
    assert time.monotonic() - started < EXIT_WITHIN_S
    assert out == b""
    lines = [json.loads(raw) for raw in err.splitlines()]  # JSON lines only
    [misconfigured] = [line for line in lines if line.get("event") == "gateway.misconfigured"]
    assert misconfigured["level"] == "error"
    assert "TETHER_GATEWAY_CALLERS_FILE" in misconfigured["error"], misconfigured
    assert "gateway.listening" not in [line.get("event") for line in lines]
