"""W1 and the awaited calls (W2) on Restate, for Tether's throughput and latency ratios.

The same workload in Restate's terms (`bench/peers/restate_services.py`): the child is a
virtual object keyed by the run's id whose handler journals the 5 progress values and the
2 milestones as its state, does the work in a journaled step and sends the finish hook a
one-way message; the hook (a plain service, or a virtual object keyed by the run's id)
tells this driver with a line on a Unix socket, as the Tether bench app's hook handler counts
its hooks. The driver submits each run through Restate's ingress as a one-way call
(`POST /W1Child/<run>/run/send`) with the run's id as its `idempotency-key`; W2 is 200
request-response calls (`POST /W1Child/<run>/run`) one after another, with no hook.

A configuration (`point`) runs `restate-server` (the npm package's binary, pinned in
`RESTATE_VERSION`) with a fresh store, hypercorn serving the SDK's app in `workers`
processes (uvloop), and this driver with `in_flight` submissions at a time (at most
`MAX_OPEN` runs submitted and not yet finished, as Tether's W1), all in a network namespace
of their own with only loopback (`unshare --net`): the server checks for a newer
release on every start and has no setting that stops it, so it never runs where it could
reach anything beyond this machine. The namespace also gives each point Restate's default
ports to itself.

Swept: SDK worker processes, submissions in flight, partitions (each a thread of the
server; Restate's default is 24), the local log's fsync (`bifrost.local`
`rocksdb-disable-wal-fsync`; on by default) and the hook as a service or a keyed object.
The reference is Restate as deployed by default: its server's defaults (24 partitions,
fsync on).

Correctness comes from Restate's own tables (its SQL introspection on the admin port):
every run's child invocation completed successfully, once; one hook invocation per child
invocation, completed; the run's milestones state is both milestones in order; the
driver saw each run's hook once.

    python -m bench.peers.restate_w1 --runs N [--sweep-runs M] [--grid quick] [--json]
    python -m bench.peers.restate_w1 point --config JSON --runs N
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import aiohttp

from bench.peers import sweep
from bench.stack import REPO, CpuMeter

RESTATE_VERSION = "1.7.12"
SERVER_PACKAGE = "@restatedev/restate-server-linux-x64"
INSTALL_DIR = REPO / ".venv" / "restate"
SERVER_ENV = "TETHER_BENCH_RESTATE_SERVER"
INSIDE_ENV = "TETHER_BENCH_RESTATE_NETNS"
INGRESS = "http://127.0.0.1:8080"
ADMIN = "http://127.0.0.1:9070"
DEPLOYMENT = "http://127.0.0.1:9080"
MAX_OPEN = 1000
W2_CALLS = 200
STALL_S = 20  # no hook for this long once all were submitted: the rest is lost
MILESTONES = ["half-way", "finished-work"]


def install() -> int:
    """npm's `@restatedev/restate-server-linux-x64@RESTATE_VERSION` under `.venv/restate`:
    the server's binary alone. Its wrapper package (`@restatedev/restate-server`) only
    launches that binary from Node.js, and brings a dependency whose install script reports
    the download; scripts are not run here either way."""
    if shutil.which("npm") is None:
        raise SystemExit("the Restate peer's server comes from npm: install Node.js and npm "
                         "(Debian `npm`), then run `make .venv/.restate-installed` again")
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["npm", "install", "--prefix", str(INSTALL_DIR), "--no-audit",
                           "--no-fund", "--ignore-scripts", "--no-save",
                           f"{SERVER_PACKAGE}@{RESTATE_VERSION}"], check=False).returncode


def server_binary() -> Path:
    """`$TETHER_BENCH_RESTATE_SERVER`, else the binary `make .venv/.restate-installed`
    puts under `.venv/restate`."""
    named = os.environ.get(SERVER_ENV)
    path = Path(named) if named else (INSTALL_DIR / "node_modules" / SERVER_PACKAGE / "bin"
                                      / "restate-server")
    if not path.is_file():
        raise SystemExit(f"no restate-server at {path}: run `make .venv/.restate-installed` "
                         f"(npm {SERVER_PACKAGE}@{RESTATE_VERSION}) or set {SERVER_ENV}")
    return path


def server_config(config: dict) -> str:
    fsync_off = "false" if config["fsync"] else "true"
    return (f"default-num-partitions = {config['partitions']}\n"
            "disable-telemetry = true\n"
            'log-filter = "warn"\n'
            "[bifrost.local]\n"
            f"rocksdb-disable-wal-fsync = {fsync_off}\n")


def hypercorn_config() -> str:
    """The SDK workers' server: hypercorn keeps every HTTP/2 connection the Restate server
    opens for as long as the server keeps it. Its defaults end one after 1,000 requests
    (`keep_alive_max_requests`, a GOAWAY with the streams still open: RT0010 "connection
    error received: not a result of an error", which the server retried, at 5,000 runs
    hundreds of times), after 5 s idle, and hold 100 streams at once on it."""
    return (f"h2_max_concurrent_streams = {MAX_OPEN * 4}\n"
            "keep_alive_timeout = 300\n"
            "keep_alive_max_requests = 1000000000\n")


def only_loopback() -> list[str]:
    """The network interfaces here, which must be loopback alone: refuse to go on otherwise."""
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        raise SystemExit(f"the Restate peer runs only in a network namespace with loopback "
                         f"alone; this one has {interfaces}")
    return interfaces


def in_namespace(argv: list[str]) -> int:
    """This command again, in a network namespace of its own with only loopback up."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("the Restate peer needs `unshare` (util-linux) and `ip` (iproute2) "
                         "to run the server in a network namespace of its own")
    command = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
               sys.executable, "-m", "bench.peers.restate_w1", *argv]
    return subprocess.run(command, cwd=REPO, env={**os.environ, INSIDE_ENV: "1"},
                          check=False).returncode


def _descendants(pid: int) -> list[int]:
    found = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += _descendants(int(child))
    return found


@contextlib.contextmanager
def processes(config: dict, driver_socket: Path,
              log_dir: Path) -> Iterator[tuple[subprocess.Popen, subprocess.Popen]]:
    """The server and the SDK workers (hypercorn, which starts its worker processes)."""
    (log_dir / "server.toml").write_text(server_config(config))
    (log_dir / "hypercorn.toml").write_text(hypercorn_config())
    started = []
    try:
        with open(log_dir / "server.log", "w") as server_log, \
                open(log_dir / "workers.log", "w") as workers_log:
            started.append(subprocess.Popen(
                [str(server_binary()), "--config-file", str(log_dir / "server.toml"),
                 "--base-dir", str(log_dir / "data"), "--no-logo"],
                stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True))
            started.append(subprocess.Popen(
                [sys.executable, "-m", "hypercorn", "--config",
                 str(log_dir / "hypercorn.toml"), "--worker-class", "uvloop",
                 "--workers", str(config["workers"]), "--bind", DEPLOYMENT.split("//")[1],
                 "bench.peers.restate_services:app"],
                cwd=REPO, stdout=workers_log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "TETHER_BENCH_RESTATE_DRIVER_SOCKET": str(driver_socket)}))
            yield started[0], started[1]
    finally:
        for process in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


async def _until(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if await check():
                return
        except aiohttp.ClientError as error:
            last = error
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {timeout:.0f} s ({last!r})")


async def ready(client: aiohttp.ClientSession) -> None:
    """The server healthy, the SDK workers registered, the ingress routing to them."""
    async def healthy() -> bool:
        async with client.get(f"{ADMIN}/health") as answer:
            return answer.status == 200

    async def registered() -> bool:
        async with client.post(f"{ADMIN}/deployments", json={"uri": DEPLOYMENT}) as answer:
            return answer.status in (200, 201)

    async def routed() -> bool:
        async with client.post(f"{INGRESS}/W1Child/warm-up/run", json={"n": -1}) as answer:
            return answer.status == 200

    await _until("restate-server", healthy, 60)
    await _until("the SDK workers' registration", registered, 60)
    await _until("the ingress", routed, 30)


class Hooks:
    """The hooks' lines: when each run's arrived, and how many times."""

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.seen: Counter[str] = Counter()
        self.last = 0.0
        self.done = asyncio.Event()
        self.freed: asyncio.Semaphore | None = None
        self.connections = 0
        self.closed = asyncio.Event()

    async def all_or_stalled(self, timeout: float, stall_s: float = STALL_S) -> None:
        """Until every run's hook came, `timeout` passed, or none came for `stall_s`."""
        deadline = time.monotonic() + timeout
        while not self.done.is_set():
            seen = len(self.seen)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(),
                                       min(stall_s, deadline - time.monotonic()))
            if len(self.seen) == seen or time.monotonic() >= deadline:
                return

    async def read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One SDK worker process's connection: a line per hook its handlers ran, until
        the process ends."""
        self.connections += 1
        try:
            async for line in reader:
                self.received(line)
        finally:
            writer.close()
            self.connections -= 1
            if not self.connections:
                self.closed.set()

    def received(self, line: bytes) -> None:
        run = json.loads(line)["run"]
        self.seen[run] += 1
        if self.seen[run] == 1:
            self.last = time.time()
            if self.freed is not None:
                self.freed.release()
            if len(self.seen) >= self.runs:
                self.done.set()


async def w1(client: aiohttp.ClientSession, hooks: Hooks, config: dict, runs: int, tag: str,
             timeout: float) -> dict:
    hooks.freed = asyncio.Semaphore(MAX_OPEN)
    numbers = iter(range(runs))
    errors: list[str] = []

    async def submitter() -> None:
        for n in numbers:
            await hooks.freed.acquire()
            run = f"{tag}-{n}"
            async with client.post(f"{INGRESS}/W1Child/{run}/run/send",
                                   json={"n": n, "hook": config["hook"]},
                                   headers={"idempotency-key": run}) as answer:
                if answer.status not in (200, 202):
                    errors.append(f"{run}: {answer.status} {(await answer.text())[:200]}")
                    hooks.freed.release()

    started = time.time()
    await asyncio.gather(*(submitter() for _ in range(config["in_flight"])))
    submitted = time.time()
    await hooks.all_or_stalled(timeout)
    seconds = (hooks.last or time.time()) - started
    return {"finished": len(hooks.seen), "seconds": seconds, "submit_s": submitted - started,
            "submit_errors": len(errors), "submit_error_examples": errors[:3]}


async def w2(client: aiohttp.ClientSession, calls: int, keyed: bool = True) -> dict:
    """Awaited calls one after another: each a request-response call through the ingress,
    with the run's id as its `idempotency-key` (as a Tether run is idempotent by its id),
    or without one (`keyed=False`)."""
    latencies = []
    for n in range(calls):
        began = time.perf_counter()
        run = f"w2{'' if keyed else 'u'}-{n}"
        async with client.post(f"{INGRESS}/W1Child/{run}/run", json={"n": n},
                               headers={"idempotency-key": run} if keyed else None) as answer:
            body = await answer.text()
        latencies.append((time.perf_counter() - began) * 1000)
        if answer.status != 200 or json.loads(body) != f"bench run {n} done":
            return {"error": f"call {n}: {answer.status} {body[:200]}"}
    latencies.sort()
    return {"runs": calls, "p50_ms": latencies[len(latencies) // 2],
            "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]}


async def query(client: aiohttp.ClientSession, sql: str) -> list[dict]:
    async with client.post(f"{ADMIN}/query", json={"query": sql},
                           headers={"accept": "application/json"}) as answer:
        answer.raise_for_status()
        return (await answer.json())["rows"]


async def correctness(client: aiohttp.ClientSession, tag: str, hook: str, runs: int,
                      hooks: Hooks) -> dict:
    """W1 checked from Restate's own tables, and the hooks the driver saw."""
    hook_service = "W1Hook" if hook == "service" else "W1HookObject"
    children = await query(client, (
        "SELECT id, target_service_key AS run, status, completion_result FROM sys_invocation "
        f"WHERE target_service_name = 'W1Child' AND target_service_key LIKE '{tag}-%'"))
    hook_rows = await query(client, (
        "SELECT invoked_by_id, status, completion_result FROM sys_invocation "
        f"WHERE target_service_name = '{hook_service}'"))
    milestones = await query(client, (
        "SELECT service_key AS run, value_utf8 FROM state WHERE service_name = 'W1Child' "
        f"AND key = 'milestones' AND service_key LIKE '{tag}-%'"))
    by_run = Counter(row["run"] for row in children)
    child_ids = {row["id"] for row in children}
    hooks_by_child = Counter(
        row["invoked_by_id"] for row in hook_rows
        if row["invoked_by_id"] in child_ids and row["status"] == "completed"
        and row["completion_result"] == "success")
    problems = {
        "runs_without_a_child_invocation": runs - len(by_run),
        "runs_with_more_than_one": sum(1 for c in by_run.values() if c > 1),
        "child_invocations_not_completed": sum(
            1 for row in children
            if row["status"] != "completed" or row["completion_result"] != "success"),
        "child_invocations_without_one_hook": sum(
            1 for i in child_ids if hooks_by_child.get(i) != 1),
        "runs_whose_milestones_are_not_in_order": runs - sum(
            1 for row in milestones if json.loads(row["value_utf8"]) == MILESTONES),
        "hooks_the_driver_did_not_see": runs - len(hooks.seen),
    }
    # Counted, not failed: Restate runs a journaled step again when the invocation's
    # stream broke before the step's entry was stored, and its tables still show one
    # invocation (at least once, as documented).
    again = sum(1 for c in hooks.seen.values() if c > 1)
    return {"correct": not any(problems.values()), **problems, "hooks_run_again": again}


async def settled_correctness(client: aiohttp.ClientSession, tag: str, hook: str, runs: int,
                              hooks: Hooks, within: float = 30) -> dict:
    """`correctness` once it holds, or as it stands after `within` seconds: a hook tells
    the driver before its own invocation is recorded completed."""
    deadline = time.monotonic() + within
    while True:
        verdict = await correctness(client, tag, hook, runs, hooks)
        if verdict["correct"] or time.monotonic() > deadline:
            return verdict
        await asyncio.sleep(0.2)


async def drive(config: dict, runs: int, log_dir: Path, timeout: float) -> dict:
    tag = f"w1-{config['hook']}"
    hooks = Hooks(runs)
    driver_socket = log_dir / "driver.sock"
    listener = await asyncio.start_unix_server(hooks.read, str(driver_socket))
    try:
        with processes(config, driver_socket, log_dir) as (server, workers):
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=config["in_flight"] + 8),
                    timeout=aiohttp.ClientTimeout(total=120)) as client:
                await ready(client)
                # (hypercorn's worker processes are up once the workers are registered.)
                meter = CpuMeter({"restate-server": [server.pid],
                                  "sdk-workers": _descendants(workers.pid),
                                  "driver": [os.getpid()]})
                meter.start()
                measured = await w1(client, hooks, config, runs, tag, timeout)
                used = meter.stop()
                measured["cpu_ms_per_run"] = {
                    name: used[name] * 1000 / max(1, measured["finished"])
                    for name in ("restate-server", "sdk-workers", "driver")}
                measured["cpu_ms_per_run"]["all"] = sum(measured["cpu_ms_per_run"].values())
                measured["correctness"] = await settled_correctness(client, tag, config["hook"],
                                                                     runs, hooks)
                measured["w2"] = await w2(client, W2_CALLS)
                measured["w2_unkeyed"] = await w2(client, W2_CALLS, keyed=False)
        # The workers are gone: their connections end.
        if hooks.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hooks.closed.wait(), 10)
    finally:
        listener.close()
    return measured


def _retries(scratch: Path) -> int:
    """The invocations the server retried after an error (its log's warnings)."""
    log = scratch / "server.log"
    return log.read_text().count("Invocation error, retrying") if log.exists() else 0


def _log_ends(scratch: Path) -> str:
    """The last lines of the server's and the SDK workers' logs."""
    return "".join(f"{name}: ...{(scratch / name).read_text()[-1500:]}\n"
                   for name in ("server.log", "workers.log") if (scratch / name).exists())


def point(args: argparse.Namespace) -> int:
    if os.environ.get(INSIDE_ENV) != "1":
        return in_namespace(sys.argv[1:] if args.argv is None else args.argv)
    network = only_loopback()
    config = json.loads(args.config)
    timeout = args.timeout or 60 + args.runs / 5
    with tempfile.TemporaryDirectory(prefix="tether-bench-restate-") as scratch:
        try:
            measured = asyncio.run(drive(config, args.runs, Path(scratch), timeout))
        except (RuntimeError, OSError, aiohttp.ClientError) as error:
            # Not ready, or the server or a worker gone: the error and their logs' ends.
            print(f"{error!r}\n{_log_ends(Path(scratch))}", file=sys.stderr)
            return 1
        logs = _log_ends(Path(scratch))
        measured["invocations_retried"] = _retries(Path(scratch))
    seconds = measured["seconds"]
    correct = measured["correctness"]["correct"]
    result = {"config": config, "label": sweep.label(config), "runs": args.runs,
              "network": network, **measured,
              # A run the tables do not show whole did not finish.
              "runs_per_s": measured["finished"] / seconds if seconds > 0 and correct else 0}
    if not correct:
        result["error"] = f"incorrect: {json.dumps(measured['correctness'])}\n{logs}"
    print(json.dumps(result))
    return 0


# --- the sweep --------------------------------------------------------------------------

def configuration(workers: int = 2, in_flight: int = 64, partitions: int = 2,
                  fsync: bool = False, hook: str = "service") -> dict:
    return {"workers": workers, "in_flight": in_flight, "partitions": partitions,
            "fsync": fsync, "hook": hook}


# Restate's server as deployed by default: 24 partitions, the log synced.
DEFAULT = configuration(partitions=24, fsync=True)


def grid(name: str) -> list[dict]:
    """The configurations of a sweep: `default` (one setting at a time around the best
    found by hand, and Restate's defaults), or `quick` (two points, for tests)."""
    if name == "quick":
        return [configuration(), DEFAULT]
    return [configuration(), configuration(workers=1), configuration(workers=3),
            configuration(in_flight=32), configuration(in_flight=128),
            configuration(partitions=1), configuration(partitions=4),
            configuration(partitions=24), configuration(fsync=True),
            configuration(hook="object"), DEFAULT]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--runs", type=int, default=5000)
    parser.add_argument("--sweep-runs", type=int, default=400,
                        help="runs per configuration of the sweep; the best and the default "
                             "configurations are run again with --runs (default 400)")
    parser.add_argument("--grid", choices=["default", "quick"], default="default")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    sub.add_parser("install", help=f"npm install {SERVER_PACKAGE}@{RESTATE_VERSION} under "
                                   f"{INSTALL_DIR}")
    p = sub.add_parser("point", help="one configuration (JSON), in a network namespace")
    p.add_argument("--config", required=True)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--timeout", type=float)
    args = parser.parse_args(argv)
    if args.command == "install":
        return install()
    if args.command == "point":
        args.argv = argv
        return point(args)
    server_binary()  # a clear error before the first point, not one per point

    def run(config: dict, runs: int) -> dict:
        return sweep.run_point("bench.peers.restate_w1", config, runs, [])

    result = sweep.sweep("restate", grid(args.grid), DEFAULT, args.runs, args.sweep_runs, run,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    result["version"] = f"restate-server {RESTATE_VERSION}, restate-sdk {version('restate-sdk')}"
    sweep.emit("Restate", result, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
