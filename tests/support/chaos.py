"""The chaos harness: servers of the test's own to stop, kill and restart, the services
as processes, a mixed load from an application, and the checks every scenario makes.

Each scenario owns its nats-server(s) and its Postgres (`chaos_servers`; the suite's
shared ones are never touched), starts the four services, puts a load on them, injects one fault while the
load runs, lets the system settle, and checks from the log and the application:

- every accepted request reached its outcome (`completed`), and exactly one outcome
  event per run is in the log;
- no child turn ran twice unless its runner died or stalled (one `run.running` per run),
  one child turn started per `run.running`, and none for an attempt superseded or a run
  already ended (`chaos_checks.turn_problems`);
- no run was given up for silence while its progress kept within its budget;
- no finish hook was handled twice, and every one was handled and is in the ledger;
- the projections equal a replay of the log (`verify`), and show every run completed;
- every service is ready again;
- at most one projector and one reconciler acted at any moment (from their log lines),
  and none acted after waking from a pause during which another took its lease
  (`chaos_checks.stale_lease_problems` says what that covers).

The faults are real: processes are stopped with SIGSTOP and continued with SIGCONT
(`pause_*`), and clocks are skewed with libfaketime (`skewed_clock.faketime_env`).
"""

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from chaos_checks import (
    Appended,
    Pause,
    ServiceLine,
    TurnStart,
    clock,
    leadership_terms,
    no_progress_problems,
    outcome_problems,
    overlapping_terms,
    stale_lease_problems,
    turn_problems,
)
from chaos_servers import Nats, Postgres
from delivery_ledger import ledger_entries, with_entries
from eventually import eventually
from service_processes import ServiceProcess, ready

from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import connect_nats
from tether.adapters.postgres.projector import verify
from tether.client import connect
from tether.config import Settings
from tether.contract.messages import AgentToolSuccess
from tether.domain.events import ParentRef
from tether.ports import stored_event

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "examples.chaos_agents:TracedResearcher,examples.chaos_agents:Ticker"
PARENT = ParentRef(agent="Assistant", name="chaos")
HOOK = "on_chaos_done"
SETTLE_S = 90.0


# --- the system under load -------------------------------------------------------------


@dataclass
class Load:
    detached: int = 40
    awaited: int = 10
    pace_s: float = 0.25  # between a child's steps: each run takes about 4 of these
    # Detached Ticker runs (`t-N`): a progress signal every second for `tick_s`, under a
    # no-progress budget they never come near.
    ticking: int = 0
    tick_s: float = 7.0
    tick_budget_ms: int = 5000

    def run_ids(self) -> list[str]:
        return [*self.detached_ids(), *(f"a-{i}" for i in range(self.awaited))]

    def detached_ids(self) -> list[str]:
        """The runs with a finish hook."""
        return [*(f"d-{i}" for i in range(self.detached)),
                *(f"t-{i}" for i in range(self.ticking))]


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
                 env: dict[str, str] | None = None, replicas: dict[str, int] | None = None,
                 service_env: dict[str, dict[str, str]] | None = None) -> None:
        self.root = root
        self.nats = Nats(root, nats_nodes, partitionable=partitionable)
        self.postgres = Postgres(root)
        self.prefix = "chaos"
        self.extra_env = env or {}
        # A standby projector and reconciler beside the active ones: the single-leader
        # check then means something, and a failover is exercised.
        self.replicas = {"projector": 2, "reconciler": 2, "parent": 1, "child-runner": 1,
                         **(replicas or {})}
        self.service_env = service_env or {}  # more environment for one kind of service
        self.pauses: list[Pause] = []
        # A child-runner was killed or paused: its last run.running may have no turn.
        self.runner_lost = False
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

    def env(self, name: str = "") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        env.update(TETHER_NATS_URL=self.nats.url, TETHER_DATABASE_URL=self.postgres.url,
                   TETHER_PREFIX=self.prefix, TETHER_PROJECTION_SCHEMA=self.prefix,
                   TETHER_HEALTH_PORT="0", TETHER_LOG_FORMAT="json", TETHER_AGENTS=AGENTS,
                   TETHER_LEADERSHIP_CHECK_MS="200", TETHER_WORK_ACK_WAIT_MS="3000",
                   TETHER_HOOK_LEASE_MS="2000", TETHER_DELIVERY_LEASE_MS="2000",
                   TETHER_STREAM_REPLICAS=str(self.settings.stream_replicas),
                   PYTHONPATH=str(ROOT))
        env.update(self.extra_env)
        env.update(self.service_env.get(name, {}))
        return env

    async def start(self) -> None:
        self.nats.start()
        self.postgres.start()
        for name, count in self.replicas.items():
            for _ in range(count):
                await self.start_service(name)
        await asyncio.gather(*(ready(service) for service in self.services))

    async def start_service(self, name: str) -> ServiceProcess:
        service = await ServiceProcess(name, self.env(name)).start()
        self.services.append(service)
        return service

    def of(self, name: str, leading: str | None = None) -> list[ServiceProcess]:
        """The running services of a kind, the one leading (if any; `leading`: the one
        whose service of that name leads) first."""
        return sorted((service for service in self.services if service.name == name),
                      key=lambda service: not _leading(service, leading))

    async def kill(self, service: ServiceProcess) -> None:
        self.runner_lost |= service.name == "child-runner"
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

    # --- pauses: SIGSTOP, then SIGCONT ----------------------------------------------

    async def pause_service(self, service: ServiceProcess, seconds: float,
                            meanwhile=None) -> Pause:
        """Stop `service` for `seconds`; `meanwhile(pause_started_at)` runs while it is
        stopped (it must bound itself within the pause)."""
        self.runner_lost |= service.name == "child-runner"
        return await self._paused(_who(service), lambda: service.signal(signal.SIGSTOP),
                                  lambda _: service.signal(signal.SIGCONT), seconds, meanwhile)

    async def pause_nats(self, seconds: float) -> Pause:
        node = self.nats.nodes[0]
        assert node.proc is not None
        proc = node.proc
        return await self._paused("nats-server", lambda: proc.send_signal(signal.SIGSTOP),
                                  lambda _: proc.send_signal(signal.SIGCONT), seconds)

    async def pause_postgres(self, seconds: float) -> Pause:
        pause = await self._paused("postgres", self.postgres.stop_all,
                                   self.postgres.continue_all, seconds)
        return pause

    async def _paused(self, target: str, stop, resume, seconds: float, meanwhile=None) -> Pause:
        stopped = stop()
        stopped_at = time.time()
        try:
            if meanwhile is not None:
                await meanwhile(stopped_at)
            await asyncio.sleep(max(0.0, stopped_at + seconds - time.time()))  # the pause itself
        finally:
            resume(stopped)
            pause = Pause(target, stopped_at, time.time())
            self.pauses.append(pause)
        print(f"paused {target} for {pause.continued_at - stopped_at:.1f}s "
              f"({clock(stopped_at)} to {clock(pause.continued_at)})"
              + (f": {len(stopped)} processes" if isinstance(stopped, list) else ""))
        return pause

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
        self.expected_hooks = len(load.detached_ids())
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
                    me.run_agent_tool("TracedResearcher",
                                      {"query": f"topic {i}", "pace_s": load.pace_s},
                                      run_id=f"d-{i}", detached={"on_finish": HOOK})
                    for i in range(load.detached)), *(
                    me.run_agent_tool("Ticker", {"seconds": load.tick_s, "every_s": 1.0},
                                      run_id=f"t-{i}",
                                      detached={"on_finish": HOOK,
                                                "no_progress_budget_ms": load.tick_budget_ms})
                    for i in range(load.ticking)))
                assert all(h.status in ("starting", "running") for h in handles), handles
                awaited = [asyncio.create_task(me.run_agent_tool(
                    "TracedResearcher", {"query": f"awaited {i}", "pace_s": load.pace_s},
                    run_id=f"a-{i}")) for i in range(load.awaited)]
                await fault()
                try:
                    async with asyncio.timeout(SETTLE_S):
                        results = await asyncio.gather(*awaited)
                        await self.hooks_done.wait()
                except TimeoutError:
                    raise AssertionError(
                        f"not settled {SETTLE_S:g}s after the fault: awaited runs still "
                        f"waiting {[f'a-{i}' for i, t in enumerate(awaited) if not t.done()]}, "
                        f"finish hooks not handled "
                        f"{sorted(set(load.detached_ids()) - set(self.hook_calls))}") from None
                failures = [r for r in results if not isinstance(r, AgentToolSuccess)]
                assert not failures, f"awaited runs did not succeed: {failures}"
        report.runs = len(load.run_ids())
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
            run_ids = load.run_ids()
            hooked = set(load.detached_ids())

            # Every run ended, and the ledger entries of the hooks followed the hook calls
            # through the parent.
            async def read_states() -> dict:
                entries = await ledger_entries(log, PARENT.agent)
                return {run_id: with_entries((await log.read_run(PARENT, run_id)).state,
                                             entries.get((PARENT.name, run_id), []))
                        for run_id in run_ids}

            async def settled() -> dict:
                states = await read_states()
                unsettled = {run_id: None if s is None else s.status
                             for run_id, s in states.items()
                             if s is None or s.is_open
                             or (run_id in hooked and not s.finish_delivered(s.status, HOOK))}
                return {} if unsettled else states

            try:
                states = await eventually(settled, timeout=SETTLE_S, interval=0.2)
            except AssertionError:
                unsettled = {run_id: None if s is None else s.status
                             for run_id, s in (await read_states()).items()
                             if s is None or s.is_open
                             or (run_id in hooked and not s.finish_delivered(s.status, HOOK))}
                raise AssertionError(f"runs not ended (or their finish hook not recorded) "
                                     f"{SETTLE_S:g}s after the load: {unsettled}") from None
            histories = {run_id: await self._appended(log, run_id) for run_id in run_ids}
            # The most telling first: the statuses come last.
            problems = [
                *outcome_problems(histories),
                *turn_problems(histories, self._turn_starts(),
                               runner_lost=self.runner_lost),
                *self._runner_outcome_problems(),
                *no_progress_problems(histories),
                *self._leader_problems(histories),
                *(f"run {run_id} ended {s.status}, not completed"
                  for run_id, s in states.items() if s.status != "completed"),
            ]
            assert not problems, "\n".join([f"{len(problems)} problems:", *problems])
            report.attempts_over_one = sum(1 for s in states.values() if s.attempt > 1)
            if not runner_died:
                assert report.attempts_over_one == 0, {
                    run_id: s.attempt for run_id, s in states.items() if s.attempt > 1}
            unexplained = {run_id: count for run_id, count in self.hook_calls.items()
                           if count > 1 and not self._cut_after(self.first_calls[run_id])}
            assert unexplained == {}, f"hooks handled more than once: {unexplained}"
            assert sorted(self.hook_calls) == sorted(hooked)
            last_seq = await log.stream_last_seq()
            async def projected() -> bool:
                return await self._checkpoint(pool) >= last_seq

            await eventually(projected, timeout=SETTLE_S, interval=0.1)
            rows = await pool.fetch(f'SELECT run_id, status FROM "{self.prefix}".runs')
            assert {r["run_id"]: r["status"] for r in rows} == dict.fromkeys(run_ids, "completed")
            result = await verify(pool, log, self.prefix)
            assert result.differences == [], result
            await asyncio.gather(*(ready(service, timeout=60) for service in self.services))
        finally:
            await pool.close()
            await nc.drain()

    async def _appended(self, log: EventLog, run_id: str) -> list[Appended]:
        """A run's events, each with when the broker stored it."""
        subject = log.subjects.run_events(PARENT, run_id)
        messages, more = await log.read_stored(log.subjects.events_stream, subject)
        assert more == 0, f"run {run_id} has more events than one batched read returns"
        appended = []
        for message in messages:
            headers = message.headers or {}
            stored = stored_event(int(headers["Nats-Sequence"]), subject, message.data)
            assert stored.event is not None, stored.error
            appended.append(Appended(stored.seq, stored.event,
                                     _broker_time(headers["Nats-Time-Stamp"])))
        return appended

    def _all_services(self) -> list[ServiceProcess]:
        return [*self.services, *(s for s, _ in self.retired)]

    def _lines(self, name: str) -> dict[str, list[ServiceLine]]:
        """Each instance's log lines, on this clock; of a process that runs several
        services (`projector,reconciler`), the lines of the service `name`."""
        found = {}
        for service in self._all_services():
            names = service.name.split(",")
            if name not in names:
                continue
            offset = service.clock_offset_s()
            found[_who(service)] = [ServiceLine(_who(service), line.get("event", ""),
                                                _at(line) - offset, line)
                                    for line in service.lines if "timestamp" in line
                                    and (len(names) == 1 or line.get("service") == name)]
        return found

    def _turn_starts(self) -> list[TurnStart]:
        """When each child turn started: when its runner let it start (`started_at`, read
        before the runner's last check), not when its first line was logged, which a
        process stopped (SIGSTOP) between the two logs only after it is continued."""
        return [TurnStart(line.line["run_id"], line.line["attempt"],
                          line.at - (_at(line.line) - line.line["started_at"] / 1000), who)
                for who, lines in self._lines("child-runner").items()
                for line in lines if line.event == "chaos.turn_started"]

    def _runner_outcome_problems(self) -> list[str]:
        """No run's child completion logged by two runners (`work_item.done` completed
        means the runner recorded the run's completion)."""
        done: dict[str, list[str]] = {}
        for who, lines in self._lines("child-runner").items():
            for line in lines:
                if line.event == "work_item.done" and line.line.get("outcome") == "completed":
                    done.setdefault(line.line["run_id"], []).append(
                        f"{who} (attempt {line.line.get('attempt')}, {clock(line.at)})")
        return [f"run {run_id}: {len(whom)} runners logged its completion as theirs: "
                f"{', '.join(whom)}" for run_id, whom in sorted(done.items()) if len(whom) > 1]

    def _leader_problems(self, histories: dict[str, list[Appended]]) -> list[str]:
        """At most one instance of a role led at any moment (a paused one aside), and
        none acted on a lease taken while it was paused."""
        ended_at = {_who(service): at for service, at in self.retired}
        appended = [a for history in histories.values() for a in history]
        problems = []
        for role in ("projector", "reconciler"):
            lines = self._lines(role)
            terms = leadership_terms(lines, ended_at, time.time())
            problems += overlapping_terms(role, terms, self.pauses)
            problems += stale_lease_problems(role, lines, self.pauses, appended)
        return problems

    def _cut_after(self, at: float, within_s: float = 2.0) -> bool:
        """A connection cut within `within_s` after `at`: long enough for a record the
        server acknowledged but had not yet written to disk when it was killed."""
        return any(0 <= cut - at <= within_s for cut in self.connections_cut_at)

    async def _checkpoint(self, pool: asyncpg.Pool) -> int:
        with contextlib.suppress(asyncpg.UndefinedTableError):
            return int(await pool.fetchval(
                f'SELECT coalesce(max(last_seq), 0) FROM "{self.prefix}".checkpoints'))
        return 0


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


def _leading(service: ServiceProcess, role: str | None = None) -> bool:
    """Whether it leads (`role`: its service of that name does, in a process of several)."""
    events = [line.get("event") for line in service.lines
              if line.get("event") in ("leadership.acquired", "leadership.released")
              and (role is None or line.get("service") == role)]
    return bool(events) and events[-1] == "leadership.acquired"


def _at(line: dict) -> float:
    return datetime.fromisoformat(line["timestamp"]).timestamp()


def _who(service: ServiceProcess) -> str:
    return f"{service.name} pid {service.pid}"


def _broker_time(stamp: str) -> float:
    """A `Nats-Time-Stamp` (RFC 3339, nanoseconds) as seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() \
        + float(f"0.{fraction or 0}")


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
