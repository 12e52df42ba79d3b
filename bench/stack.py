"""The servers (NATS, Postgres) and the four Tether services as real processes."""

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("parent", "child-runner", "reconciler", "projector")
# The processes of each `--followers` layout: the projector and the reconciler in one
# process (the reconciler takes what the projector commits), or each in its own.
FOLLOWERS_TOGETHER = "projector,reconciler"
LAYOUTS = {"together": ("parent", "child-runner", FOLLOWERS_TOGETHER),
           "apart": SERVICES}
PROCESSES = (*SERVICES, FOLLOWERS_TOGETHER)
BENCH_AGENT = "bench.agents:BenchChild"


def devstack():
    """scripts/devstack.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("tether_devstack", REPO / "scripts" / "devstack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def servers(nats_nodes: int = 1) -> Iterator[tuple[str, str]]:
    """(nats_url, database_url): TETHER_NATS_URL / TETHER_DATABASE_URL, else throwaway ones
    (`nats_nodes` > 1: a cluster of that many nats-servers, their URLs joined by commas)."""
    with contextlib.ExitStack() as stack:
        nats_url = os.environ.get("TETHER_NATS_URL")
        database_url = os.environ.get("TETHER_DATABASE_URL")
        if not nats_url or not database_url:
            ds = devstack()
            if not nats_url:
                nats_url = stack.enter_context(
                    ds.temporary_nats() if nats_nodes == 1
                    else ds.temporary_nats_cluster(nats_nodes))
            if not database_url:
                database_url = stack.enter_context(ds.temporary_postgres("tether_bench"))
        yield nats_url, database_url


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 and not listening. While it is open the
    kernel offers that port to no other bind, and a server that sets SO_REUSEADDR (as
    asyncio's `start_server`, the services' health server, does) still listens on it.
    A port only looked up (bound to 0, then closed) may be offered again before its server
    binds it: two services started together could then share one, and the one that lost
    the bind would go unnoticed while the other answered its readiness checks."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    return holder


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the RSS high-water mark) of a process, in KiB; {} once it is gone."""
    values = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (from /proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, in nanoseconds' precision: the process's
    CPU-time clock, which Linux derives from its pid (`MAKE_PROCESS_CPUCLOCK(pid,
    CPUCLOCK_SCHED)`). `/proc/<pid>/stat` counts clock ticks (10 ms), which round a
    process's share of a short W1 down, to nothing where it used less than a tick; they
    are the fallback where the clock cannot be read (0 once the process is gone)."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return sum(cpu_split(pid))


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def _pids_where(predicate) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if predicate([c.decode(errors="replace") for c in cmdline], int(stat[1])):
                    found.append(int(entry.name))
    return found


def server_pids(nats_url: str, database_url: str) -> dict[str, list[int]]:
    """nats-server and postgres (the postmaster and its backends) on this machine, by port.
    A cluster's nats-servers (`nats_url` lists several) are `nats-server-1`, `-2`, ...,
    each the node of the URL at that place."""
    ports = [str(urlsplit(url).port) for url in nats_url.split(",")]
    nodes = [_pids_where(lambda cmd, _ppid, port=port: "nats-server" in cmd[0] and port in cmd)
             for port in ports]
    pg_port = urlsplit(database_url).port
    postmaster = _pids_where(lambda cmd, _ppid: cmd[0].endswith("postgres")
                             and "-p" in cmd and str(pg_port) in cmd)
    backends = _pids_where(lambda _cmd, ppid: ppid in postmaster)
    nats = ({"nats-server": nodes[0]} if len(nodes) == 1 else
            {f"nats-server-{n}": pids for n, pids in enumerate(nodes, 1)})
    return {**nats, "postgres": postmaster + backends}


def nats_server_pids(pids: dict[str, list[int]]) -> list[int]:
    """Every nats-server's of `server_pids`: one, or each node of a cluster."""
    return [pid for name, group in pids.items() if name.startswith("nats-server")
            for pid in group]


class CpuMeter:
    """CPU seconds used by groups of processes (and the whole machine) between two points."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._start: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        values = {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in self.groups.items()}
        for name, pids in self.groups.items():
            splits = [cpu_split(pid) for pid in pids]
            values[f"ticks:{name}"] = sum(user + system for user, system in splits)
            values[f"kernel:{name}"] = sum(system for _, system in splits)
        values["machine_busy"], values["machine_total"] = machine_busy_seconds()
        return values

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> dict[str, float]:
        """Each group's CPU seconds, `kernel:<group>` their part in the kernel (the share of
        the group's clock ticks spent there: the kernel's split is only kept in ticks),
        the machine's busy and total seconds, and `others`, the busy seconds no group used."""
        end = self._now()
        used = {name: end[name] - self._start.get(name, 0.0) for name in end}
        for name in self.groups:
            ticks, kernel = used.pop(f"ticks:{name}"), used[f"kernel:{name}"]
            # The share first: `used * kernel / ticks` rounds above `used` when the two
            # tick counts are equal (all of it in the kernel), and a part is never more.
            used[f"kernel:{name}"] = used[name] * min(kernel / ticks, 1.0) if ticks > 0 else 0.0
        ours = sum(v for k, v in used.items() if not k.startswith(("machine_", "kernel:")))
        used["others"] = max(used["machine_busy"] - ours, 0.0)
        return used


async def http_status(port: int, path: str) -> int:
    """The HTTP status of GET path on 127.0.0.1:port; 0 when nothing answers."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, TimeoutError):
        return 0
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 5)
        parts = line.split()
        return int(parts[1]) if len(parts) > 1 else 0
    except (OSError, TimeoutError, ValueError):
        return 0
    finally:
        writer.close()


async def metric_total(port: int, name: str, labels: dict[str, str]) -> float:
    """The sum of a Prometheus metric's samples carrying `labels`, from GET /metrics on
    127.0.0.1:port; 0 when nothing answers."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, TimeoutError):
        return 0.0
    try:
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")
        await writer.drain()
        body = (await asyncio.wait_for(reader.read(), 5)).split(b"\r\n\r\n", 1)[-1]
    except (OSError, TimeoutError):
        return 0.0
    finally:
        writer.close()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in body.decode(errors="replace").splitlines():
        if line.startswith((name + "{", name + " ")) and all(label in line for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Service:
    name: str  # the service, or with replicas `<service>-<n>`
    service: str  # one of PROCESSES: a service, or services in one process
    process: subprocess.Popen
    health_port: int
    log_path: Path
    samples: dict[str, dict[str, int]] = field(default_factory=dict)
    port_reserved: socket.socket | None = None  # held until the service listens on it

    def release_port(self) -> None:
        if self.port_reserved is not None:
            self.port_reserved.close()
            self.port_reserved = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def sample(self, label: str) -> dict[str, int]:
        self.samples[label] = memory_kib(self.pid)
        return self.samples[label]

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


LEASED_ROLES = ("projector", "reconciler")  # one active instance each, under a lease


class ServiceSet:
    """`tether services NAME` for each service, log level warning, the bench child loaded.

    `replicas` runs that many processes of a service (named `<service>-1`, `-2`, ...);
    they share its durable consumers as replicas in a deployment do. `followers`: the
    projector and the reconciler in one process (`together`, `tether services
    projector,reconciler`) or in one each (`apart`).
    """

    def __init__(self, env: dict[str, str], log_dir: Path,
                 replicas: dict[str, int] | None = None, followers: str = "together") -> None:
        self.env = env
        self.entry = "tether.cli"
        self.log_dir = log_dir
        self.processes = LAYOUTS[followers]
        self.replicas = {name: 1 for name in self.processes} | (replicas or {})
        self.services: dict[str, Service] = {}
        self.wrappers: dict[str, list[str]] = {}  # a command to run a service under

    @staticmethod
    def environment(nats_url: str, database_url: str, prefix: str,
                    extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        env.update(TETHER_NATS_URL=nats_url, TETHER_DATABASE_URL=database_url,
                   TETHER_PREFIX=prefix, TETHER_PROJECTION_SCHEMA=prefix,
                   TETHER_AGENTS=BENCH_AGENT, TETHER_LOG_LEVEL="warning",
                   TETHER_LOG_FORMAT="json",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        env.update(extra or {})
        return env

    async def start(self, timeout: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self.processes:
            count = self.replicas[service]
            for n in range(1, count + 1):
                name = service if count == 1 else f"{service}-{n}"
                self.services[name] = self._spawn(service, name)
        deadline = time.monotonic() + timeout
        for service in self.services.values():
            while await http_status(service.health_port, "/readyz") != 200:
                if service.process.poll() is not None or time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"service {service.name} did not become ready; "
                                       f"log {service.log_path}:\n{service.log_tail()}")
                await asyncio.sleep(0.1)
            service.release_port()  # it answered there: it listens on its port
        # A standby is ready too; W1 starts once each leased role has its leader, which
        # takes the lease's grace after the lock (so a slowed-down follower, under
        # --callgrind, is not still standing by while W1's events go past it).
        for role in LEASED_ROLES:
            while await self._leaders(role) < 1:
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"no {role} became active within {timeout} s")
                await asyncio.sleep(0.1)

    async def _leaders(self, role: str) -> float:
        return sum([await metric_total(s.health_port, f"tether_{role}_active", {})
                    for s in self.services.values() if role in s.service.split(",")])

    def _spawn(self, service: str, name: str) -> Service:
        reserved = reserve_port()
        port = reserved.getsockname()[1]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            process = subprocess.Popen(
                [*self.wrappers.get(name, []), sys.executable, "-m", self.entry, "services",
                 service],
                env={**self.env, "TETHER_HEALTH_PORT": str(port)}, cwd=REPO,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        return Service(name, service, process, port, log_path, port_reserved=reserved)

    def sample(self, label: str) -> dict[str, dict[str, int]]:
        return {name: service.sample(label) for name, service in self.services.items()}

    def pids(self) -> dict[str, int]:
        return {name: service.pid for name, service in self.services.items()}

    async def commands_handled(self, service: str, handler: str) -> dict[str, int]:
        """How many messages each process of `service` handled with `handler` (its
        `tether_handler_seconds` count), e.g. each parent's `command.run`."""
        return {name: int(await metric_total(s.health_port, "tether_handler_seconds_count",
                                             {"service": service, "handler": handler}))
                for name, s in self.services.items() if s.service == service}

    def service_of(self) -> dict[str, str]:
        """Each process's service: `parent-2` -> `parent`."""
        return {name: service.service for name, service in self.services.items()}

    def crashed(self) -> list[str]:
        return [n for n, s in self.services.items() if s.process.poll() is not None]

    async def stop(self, grace: float = 20.0) -> dict[str, int | None]:
        for service in self.services.values():
            service.release_port()
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes = {}
        for name, service in self.services.items():
            # A process's exit has nothing to await: it is polled until the deadline.
            while service.process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            if service.process.poll() is None:
                service.process.kill()
                service.process.wait()
            codes[name] = service.process.returncode
        return codes
