"""The chaos harness: servers of the test's own to stop, kill and restart, the services
as processes, a mixed load from an application, and the checks every scenario makes.

Each scenario owns its nats-server(s) and its Postgres (the suite's shared ones are never
touched), starts the four services, puts a load on them, injects one fault while the
load runs, lets the system settle, and checks from the log and the application:

- every accepted request reached its outcome (`completed`);
- no child turn ran twice unless its runner died (one `run.running` per run);
- no finish hook was handled twice, and every one was handled and is in the ledger;
- the projections equal a replay of the log (`verify`), and show every run completed;
- every service is ready again;
- at most one projector and one reconciler acted at any moment (from their log lines).
"""

import asyncio
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from eventually import eventually
from service_processes import ServiceProcess, ready

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.projector import verify
from tether.client import connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.domain.events import ParentRef

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "examples.agents:Researcher"
PARENT = ParentRef(agent="Assistant", name="chaos")
HOOK = "on_chaos_done"
SETTLE_S = 90.0


def _devstack():
    spec = importlib.util.spec_from_file_location("tether_devstack_chaos",
                                                  ROOT / "scripts" / "devstack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


devstack = _devstack()


# --- servers ------------------------------------------------------------------------


@dataclass
class NatsNode:
    name: str
    port: int
    monitor: int
    cluster_port: int | None
    store: Path
    log: Path
    proc: subprocess.Popen | None = None


class Nats:
    """One nats-server, or a cluster of three with JetStream on each (R3 streams).

    `partitionable`: the third node runs in a network namespace of its own, joined to
    the others by a veth pair, so that a test can cut it off (`partition`) and join it
    again (`heal`) while it keeps running. The services connect to the other two.
    """

    def __init__(self, root: Path, nodes: int = 1, *, partitionable: bool = False) -> None:
        free = devstack.free_port
        self.nodes = [NatsNode(f"n{i}", free(), free(), free() if nodes > 1 else None,
                               root / f"nats-{i}", root / f"nats-{i}.log") for i in range(nodes)]
        self.net: Netns | None = Netns() if partitionable else None

    def host_of(self, node: NatsNode) -> str:
        if self.net is None:
            return "127.0.0.1"
        return self.net.inside if node is self.nodes[-1] else self.net.outside

    @property
    def url(self) -> str:
        reachable = self.nodes[:-1] if self.net is not None else self.nodes
        return ",".join(f"nats://127.0.0.1:{node.port}" for node in reachable)

    def start(self, index: int | None = None) -> None:
        if self.net is not None:
            self.net.create()
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.store.mkdir(parents=True, exist_ok=True)
            inside = self.net is not None and node is self.nodes[-1]
            client_host = self.net.inside if inside else "127.0.0.1"
            cmd = [devstack.find_nats_server(), "-a", client_host, "-p", str(node.port),
                   "-m", str(node.monitor), "-js", "-sd", str(node.store), "-n", node.name]
            if inside:
                cmd = ["ip", "netns", "exec", self.net.name, *cmd]
            if node.cluster_port is not None:
                routes = ",".join(f"nats://{self.host_of(other)}:{other.cluster_port}"
                                  for other in self.nodes if other is not node)
                cmd += ["--cluster_name", "chaos", "--cluster",
                        f"nats://{self.host_of(node)}:{node.cluster_port}", "--routes", routes]
            node.proc = devstack.spawn(cmd, node.log, parent_death_signal=signal.SIGKILL,
                                       extra_env={"GOMAXPROCS": "1"})
        for node in self.nodes if index is None else [self.nodes[index]]:
            self._wait_healthy(node)

    def partition(self) -> None:
        assert self.net is not None
        self.net.link(up=False)

    def heal(self) -> None:
        assert self.net is not None
        self.net.link(up=True)

    def _wait_healthy(self, node: NatsNode) -> None:
        monitor_host = self.net.inside if self.net is not None and node is self.nodes[-1] \
            else "127.0.0.1"
        url = f"http://{monitor_host}:{node.monitor}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as r:
                if json.load(r).get("status") == "ok":
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server {node.name} not healthy:\n{devstack.log_tail(node.log)}")

    def stop(self, index: int = 0, sig: int = signal.SIGTERM) -> None:
        node = self.nodes[index]
        assert node.proc is not None
        node.proc.send_signal(sig)
        node.proc.wait(timeout=30)
        node.proc = None

    def leader_of(self, stream: str) -> int:
        """The index of the node leading `stream` (from a node's monitoring endpoint)."""
        for node in self.nodes:
            if node.proc is None:
                continue
            if self.net is not None and node is self.nodes[-1]:
                continue  # cut off, perhaps: the others know who leads
            url = f"http://127.0.0.1:{node.monitor}/jsz?streams=true"
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2) as r:
                for account in json.load(r).get("account_details", []):
                    for detail in account.get("stream_detail", []):
                        if detail["name"] == stream and detail.get("cluster", {}).get("leader"):
                            leader = detail["cluster"]["leader"]
                            return next(i for i, n in enumerate(self.nodes) if n.name == leader)
        raise RuntimeError(f"no leader found for {stream}")

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(Exception):
                    node.proc.kill()
                    node.proc.wait(timeout=10)
        if self.net is not None:
            self.net.remove()


class Netns:
    """A network namespace of the test's own, joined to this one by a veth pair on a
    /30 of 10.213.0.0/16 (addresses of these test hosts only)."""

    def __init__(self) -> None:
        tag = os.urandom(3).hex()
        self.name, self._host_if, self._inner_if = f"tch{tag}", f"vh{tag}", f"vn{tag}"
        block = int(tag, 16) % 16_000 * 4  # a /30 inside 10.213.0.0/16
        base = f"10.213.{block // 256}.{block % 256}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.outside, self.inside = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
        self.created = False

    def create(self) -> None:
        if self.created:
            return
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self._host_if, "type", "veth", "peer", "name",
                     self._inner_if],
                    ["ip", "link", "set", self._inner_if, "netns", self.name],
                    ["ip", "addr", "add", f"{self.outside}/30", "dev", self._host_if],
                    ["ip", "link", "set", self._host_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.inside}/30",
                     "dev", self._inner_if],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", self._inner_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        self.created = True

    def link(self, *, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self._host_if, "up" if up else "down"], check=True,
                       capture_output=True)

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self._host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)


def namespaces_available() -> str | None:
    """None when this machine lets the tests make network namespaces; else why not."""
    probe = Netns()
    try:
        probe.create()
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return f"network namespaces are not available here: {error} {detail.decode().strip()}"
    finally:
        probe.remove()
    return None


class Postgres:
    def __init__(self, root: Path) -> None:
        self.data = root / "pg"
        self.log = root / "pg.log"
        self.port = devstack.free_port()
        self.proc: subprocess.Popen | None = None
        self.bindir = ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/chaos"

    def start(self) -> None:
        self.proc, self.bindir = devstack.start_postgres(self.data, self.port, self.log,
                                                         daemon=False)
        devstack.create_database(self.bindir, self.port, "chaos")

    def stop(self, mode: str = "fast") -> None:
        """`pg_ctl stop -m fast` (SIGINT) or `-m immediate` (SIGQUIT)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT if mode == "fast" else signal.SIGQUIT)
        self.proc.wait(timeout=30)
        self.proc = None

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.send_signal(signal.SIGQUIT)
                self.proc.wait(timeout=10)


# --- the system under load -------------------------------------------------------------


@dataclass
class Load:
    detached: int = 40
    awaited: int = 10
    pace_s: float = 0.25  # between a child's steps: each run takes about 4 of these


@dataclass
class Report:
    scenario: str
    runs: int = 0
    seconds: float = 0.0
    attempts_over_one: int = 0
    hooks_repeated: int = 0
    restarts: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"chaos {self.scenario}: {self.runs} runs settled in {self.seconds:.1f}s; "
                f"{self.attempts_over_one} runs took another attempt, "
                f"{self.hooks_repeated} hooks handled twice"
                + (" (each within 2 s before the broker was killed)" if self.hooks_repeated
                   else ""))


class System:
    """The servers, the services as processes, and the application."""

    def __init__(self, root: Path, *, nats_nodes: int = 1, partitionable: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.root = root
        self.nats = Nats(root, nats_nodes, partitionable=partitionable)
        self.postgres = Postgres(root)
        self.prefix = "chaos"
        self.extra_env = env or {}
        self.services: list[ServiceProcess] = []
        self.retired: list[tuple[ServiceProcess, float]] = []  # stopped, with when
        self.hook_calls: Counter[str] = Counter()
        self.first_calls: dict[str, float] = {}
        # When a fault cut every connection at once (a killed broker): a hook handled
        # just before may have lost its acknowledgement and its record with it.
        self.connections_cut_at: list[float] = []
        self.hooks_done = asyncio.Event()
        self.expected_hooks = 0
        self.app_lines: list[tuple[str, str]] = []  # (ISO time, the library's log line)

    @property
    def settings(self) -> Settings:
        return Settings(nats_url=self.nats.url, database_url=self.postgres.url,
                        prefix=self.prefix, projection_schema=self.prefix,
                        stream_replicas=3 if len(self.nats.nodes) > 1 else 1)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        env.update(TETHER_NATS_URL=self.nats.url, TETHER_DATABASE_URL=self.postgres.url,
                   TETHER_PREFIX=self.prefix, TETHER_PROJECTION_SCHEMA=self.prefix,
                   TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json", TETHER_AGENTS=AGENTS,
                   TETHER_LEADERSHIP_CHECK_MS="200", TETHER_WORK_ACK_WAIT_MS="3000",
                   TETHER_HOOK_LEASE_MS="2000", TETHER_DELIVERY_LEASE_MS="2000",
                   TETHER_STREAM_REPLICAS=str(self.settings.stream_replicas),
                   PYTHONPATH=str(ROOT))
        env.update(self.extra_env)
        return env

    async def start(self) -> None:
        self.nats.start()
        self.postgres.start()
        # A standby projector and reconciler beside the active ones: the single-leader
        # check then means something, and a failover is exercised.
        for name in ("projector", "projector", "reconciler", "reconciler", "parent",
                     "child-runner"):
            await self.start_service(name)
        await asyncio.gather(*(ready(service) for service in self.services))

    async def start_service(self, name: str) -> ServiceProcess:
        service = await ServiceProcess(name, self.env()).start()
        self.services.append(service)
        return service

    def of(self, name: str) -> list[ServiceProcess]:
        """The running services of a kind, the one leading (if any) first."""
        return sorted((service for service in self.services if service.name == name),
                      key=lambda service: not _leading(service))

    async def kill(self, service: ServiceProcess) -> None:
        service.signal(signal.SIGKILL)
        await service.wait()
        self.services.remove(service)
        self.retired.append((service, time.time()))

    async def terminate(self, service: ServiceProcess) -> int:
        service.signal(signal.SIGTERM)
        code = await service.wait(timeout=60)
        self.services.remove(service)
        self.retired.append((service, time.time()))
        return code

    async def close(self) -> None:
        for service in [*self.services, *(s for s, _ in self.retired)]:
            await service.stop()
        self.nats.close()
        self.postgres.close()

    def dump_logs(self) -> None:
        services = [*self.services, *(s for s, _ in self.retired)]
        for service in services:
            print(f"--- {service.name} (last 80 log lines) ---")
            for line in service.lines[-80:]:
                print(json.dumps(line))
        # Every line about a hook handled more than once, in the services and the
        # application, in time order: what the ledger, the records and the retries did.
        repeated = [run_id for run_id, count in self.hook_calls.items() if count > 1]
        if not repeated:
            return
        print(f"--- lines about the repeated hooks {repeated}; broker cut at "
              f"{self.connections_cut_at} ---")
        about = [(line.get("timestamp", ""), service.name, json.dumps(line))
                 for service in services for line in service.lines
                 if any(run_id in json.dumps(line) for run_id in repeated)]
        about += [(at, "application", text) for at, text in self.app_lines
                  if any(run_id in text for run_id in repeated)]
        for at, who, text in sorted(about):
            print(at, who, text)

    # --- the application -----------------------------------------------------------

    async def run_load(self, load: Load, fault, report: Report, *,
                       runner_died: bool = False) -> None:
        """Submit the load, inject `fault()` while its children run, and wait until
        every run settled (bounded)."""
        started = time.monotonic()
        self.expected_hooks = load.detached
        async with _application_lines(self.app_lines), \
                connect(settings=self.settings, name="chaos-app") as tether:
            hooks = tether.hooks(PARENT.agent)

            @hooks.on_finish(HOOK)
            async def on_done(run, result) -> None:
                self.hook_calls[run.run_id] += 1
                self.first_calls.setdefault(run.run_id, time.time())
                if len(self.hook_calls) >= self.expected_hooks:
                    self.hooks_done.set()

            me = tether.parent(PARENT.agent, PARENT.name)
            async with hooks.running():
                handles = await asyncio.gather(*(
                    me.run_agent_tool("Researcher", {"query": f"topic {i}", "pace_s": load.pace_s},
                                      run_id=f"d-{i}", detached={"on_finish": HOOK})
                    for i in range(load.detached)))
                assert all(h.status in ("starting", "running") for h in handles), handles
                awaited = [asyncio.create_task(me.run_agent_tool(
                    "Researcher", {"query": f"awaited {i}", "pace_s": load.pace_s},
                    run_id=f"a-{i}")) for i in range(load.awaited)]
                await fault()
                async with asyncio.timeout(SETTLE_S):
                    results = await asyncio.gather(*awaited)
                    await self.hooks_done.wait()
                failures = [r for r in results if not isinstance(r, AgentToolSuccess)]
                assert not failures, f"awaited runs did not succeed: {failures}"
        report.runs = load.detached + load.awaited
        report.hooks_repeated = sum(count - 1 for count in self.hook_calls.values())
        await self.settle_and_check(load, report, runner_died=runner_died)
        report.seconds = time.monotonic() - started

    async def settle_and_check(self, load: Load, report: Report, *,
                               runner_died: bool = False) -> None:
        settings = self.settings
        nc = await connect_nats(settings.nats_connect_url, name="chaos-check",
                                startup_timeout_s=30)
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
        try:
            log = EventLog(nc, settings.subjects)
            run_ids = [f"d-{i}" for i in range(load.detached)] + [f"a-{i}" for i in range(load.awaited)]
            async with asyncio.timeout(SETTLE_S):
                # The ledger entries follow the hook calls through the parent.
                while True:
                    states = {run_id: (await log.read_run(PARENT, run_id)).state
                              for run_id in run_ids}
                    if all(s is not None and s.status == "completed" for s in states.values()) \
                            and all(s.finish_delivered("completed", HOOK)
                                    for run_id, s in states.items() if run_id.startswith("d-")):
                        break
                    await asyncio.sleep(0.2)
            report.attempts_over_one = sum(1 for s in states.values() if s.attempt > 1)
            if not runner_died:
                assert report.attempts_over_one == 0, {
                    run_id: s.attempt for run_id, s in states.items() if s.attempt > 1}
            unexplained = {run_id: count for run_id, count in self.hook_calls.items()
                           if count > 1 and not self._cut_after(self.first_calls[run_id])}
            assert unexplained == {}, f"hooks handled more than once: {unexplained}"
            assert sorted(self.hook_calls) == sorted(r for r in run_ids if r.startswith("d-"))
            last_seq = await log.stream_last_seq()
            async def projected() -> bool:
                return await self._checkpoint(pool) >= last_seq

            await eventually(projected, timeout=SETTLE_S, interval=0.1)
            rows = await pool.fetch(f'SELECT run_id, status FROM "{self.prefix}".runs')
            assert {r["run_id"]: r["status"] for r in rows} == dict.fromkeys(run_ids, "completed")
            result = await verify(pool, log, self.prefix)
            assert result.differences == [], result
            await asyncio.gather(*(ready(service, timeout=60) for service in self.services))
            self.check_single_leaders()
        finally:
            await pool.close()
            await nc.drain()

    def _cut_after(self, at: float, within_s: float = 2.0) -> bool:
        """A connection cut within `within_s` after `at`: long enough for a record the
        server acknowledged but had not yet written to disk when it was killed."""
        return any(0 <= cut - at <= within_s for cut in self.connections_cut_at)

    async def _checkpoint(self, pool: asyncpg.Pool) -> int:
        with contextlib.suppress(asyncpg.UndefinedTableError):
            return int(await pool.fetchval(
                f'SELECT coalesce(max(last_seq), 0) FROM "{self.prefix}".checkpoints'))
        return 0

    def check_single_leaders(self) -> None:
        """No two instances of a role held their lease (acting) at one moment."""
        ended_at = {id(service): at for service, at in self.retired}
        for role in ("projector", "reconciler"):
            terms: list[tuple[float, float, str]] = []
            for service in [*self.services, *(s for s, _ in self.retired)]:
                if service.name != role:
                    continue
                start = None
                for line in service.lines:
                    if line.get("event") == "leadership.acquired":
                        start = _at(line)
                    elif line.get("event") == "leadership.released" and start is not None:
                        terms.append((start, _at(line), f"{role}@{id(service)}"))
                        start = None
                if start is not None:
                    terms.append((start, ended_at.get(id(service), time.time()),
                                  f"{role}@{id(service)}"))
            terms.sort()
            for (_, end, who), (start, _, other) in itertools.pairwise(terms):
                assert start >= end, f"{who} and {other} both led {role} at {start}"


class _Lines(logging.Handler):
    def __init__(self, lines: list[tuple[str, str]]) -> None:
        super().__init__(logging.INFO)
        self._lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        at = datetime.fromtimestamp(record.created, tz=UTC).isoformat()
        self._lines.append((at, record.getMessage()))


@contextlib.asynccontextmanager
async def _application_lines(lines: list[tuple[str, str]]):
    """The library's log lines inside the load's application (its hook handler), kept."""
    logger = logging.getLogger("tether")
    handler, level = _Lines(lines), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _leading(service: ServiceProcess) -> bool:
    events = [line.get("event") for line in service.lines
              if line.get("event") in ("leadership.acquired", "leadership.released")]
    return bool(events) and events[-1] == "leadership.acquired"


def _at(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"]).timestamp()


@contextlib.asynccontextmanager
async def chaos_system(**options):
    root = Path(tempfile.mkdtemp(prefix="tether-chaos-"))
    os.chmod(root, 0o755)  # the postgres user must reach its data dir
    system = System(root, **options)
    failed = True
    try:
        await system.start()
        yield system
        failed = False
    finally:
        if failed:
            system.dump_logs()
        await system.close()
        shutil.rmtree(root, ignore_errors=True)
