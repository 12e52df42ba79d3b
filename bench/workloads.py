"""W1 (N detached runs with finish hooks), W2 (awaited runs one by one), and the rebuild."""

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import asyncpg

from bench import stages
from bench.counters import ServerCounters
from bench.stack import REPO, CpuMeter, ServiceSet, cpu_seconds, nats_server_pids
from bench.stats import latency_summary
from tether.client import ParentHandle, Tether
from tether.client.parent import build_run_command
from tether.contract.messages import AgentToolSuccess, DetachedHandle

AGENT = "BenchChild"
PARENT_AGENT = "BenchApp"
HOOK_METHOD = "on_bench_done"


class Positions:
    """The log's last sequence and the projector's committed checkpoint."""

    def __init__(self, tether: Tether, db: asyncpg.Connection, schema: str) -> None:
        self._tether, self.db = tether, db
        self.db_lock = asyncio.Lock()  # the sampler and the counters share the connection
        self._sql = f'SELECT coalesce(max(last_seq), 0) FROM "{schema}".checkpoints'

    async def read(self) -> tuple[int, int]:
        last_seq = await self._tether.log.stream_last_seq()
        async with self.db_lock:
            return last_seq, int(await self.db.fetchval(self._sql))

    async def consumers(self) -> int:
        """Consumers on the events stream now (the client's ordered feeds among them)."""
        info = await self._tether.js.stream_info(self._tether.subjects.events_stream)
        return int(info.state.consumer_count)

    async def wait_caught_up(self, timeout: float) -> tuple[float, int, int]:
        """Poll until the checkpoint reaches the log's end; (time, last_seq, checkpoint)."""
        deadline = time.time() + timeout
        while True:
            last_seq, checkpoint = await self.read()
            now = time.time()
            if checkpoint >= last_seq or now > deadline:
                return now, last_seq, checkpoint
            await asyncio.sleep(0.02)


class Probe:
    """bench.probe in its own process: progress latency as a timeline subscriber sees it."""

    def __init__(self, nats_url: str, prefix: str, out: Path, count_subjects: bool = False,
                 event_loop: str = "uvloop") -> None:
        self._args = [sys.executable, "-m", "bench.probe", "--nats-url", nats_url,
                      "--prefix", prefix, "--out", str(out), "--event-loop", event_loop]
        if count_subjects:
            self._args.append("--count-subjects")
        self.subjects: dict[str, int] = {}
        self._out = out
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            *self._args, cwd=REPO, stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(self._process.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"progress probe did not start: {line!r}")

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """On an error, do not leave the probe behind."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()

    async def stop(self) -> list[tuple[float, float, int]]:
        assert self._process is not None
        self._process.terminate()
        await asyncio.wait_for(self._process.wait(), 30)
        result = json.loads(self._out.read_text())
        self._out.unlink()
        self.subjects = result["subjects"]
        return [tuple(x) for x in result["progress"]]


@dataclass
class W1Recorder:
    """The bench application's finish hook: when each run's hook was handled."""

    runs: int
    on_count: dict[int, callable] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    calls: int = 0
    calls_by_run: Counter = field(default_factory=Counter)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progressed: asyncio.Event = field(default_factory=asyncio.Event)  # a run finished

    def expect_one_less(self) -> None:
        self.runs -= 1
        if len(self.finished) >= self.runs:
            self.done.set()

    async def hook(self, run, result) -> None:
        self.calls += 1
        self.calls_by_run[run.run_id] += 1
        if run.run_id in self.finished:
            return  # a second call for one run: counted in `calls`, reported as duplicates
        self.finished[run.run_id] = time.time()
        self.progressed.set()
        self.statuses[result.status] += 1
        action = self.on_count.get(len(self.finished))
        if action is not None:
            action()
        if len(self.finished) >= self.runs:
            self.done.set()


async def _sampler(positions: Positions, services: ServiceSet, recorder: W1Recorder,
                   timeline: list[dict], stop: asyncio.Event, every: float = 0.25) -> None:
    pids = services.pids()
    while not stop.is_set():
        last_seq, checkpoint = await positions.read()
        memory = services.sample(f"t{len(timeline)}")
        timeline.append({"t": time.time(), "finished": len(recorder.finished),
                         "last_seq": last_seq, "checkpoint": checkpoint,
                         "consumers": await positions.consumers(),
                         "rss_kib": {n: m.get("VmRSS", 0) for n, m in memory.items()},
                         "cpu_s": {n: cpu_seconds(pid) for n, pid in pids.items()}})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


def _memory_timeline(timeline: list[dict], points: int = 60) -> dict:
    """RSS (KiB) of each service against finished runs, at most `points` samples."""
    step = max(len(timeline) // points, 1)
    chosen = timeline[::step] + timeline[-1:]
    return {"finished": [p["finished"] for p in chosen],
            "rss_kib": {name: [p["rss_kib"].get(name, 0) for p in chosen]
                        for name in (timeline[0]["rss_kib"] if timeline else {})}}


def _fill_memory_samples(services: ServiceSet, timeline: list[dict], finished: int) -> None:
    """When fewer runs finished than asked, take the N/2 and N samples from the timeline."""
    if not timeline:
        return
    half = next((p for p in timeline if p["finished"] >= finished / 2), timeline[-1])
    three_quarters = next((p for p in timeline if p["finished"] >= 3 * finished / 4),
                          timeline[-1])
    for name, service in services.services.items():
        if "half" not in service.samples:
            service.samples["half"] = {"VmRSS": half["rss_kib"].get(name, 0)}
        if "three_quarters" not in service.samples:
            service.samples["three_quarters"] = {"VmRSS": three_quarters["rss_kib"].get(name, 0)}
        if "end" not in service.samples:
            service.samples["end"] = {"VmRSS": timeline[-1]["rss_kib"].get(name, 0)}


def _by_service(cpu_used: dict[str, float], service_of: dict[str, str], runs: int) -> dict:
    """CPU ms per run of each service's processes together (`parent-1` + `parent-2` ->
    `parent`), and of the other processes as they are."""
    totals: Counter = Counter()
    for name, used in cpu_used.items():
        if not name.startswith(("machine_", "kernel:")):
            totals[service_of.get(name, name)] += 1000 * used / max(runs, 1)
    return dict(totals)


async def _submit_client(parent: ParentHandle, n: int, run_id: str) -> DetachedHandle:
    """What an application does: `run_agent_tool(..., detached=...)`, which waits for the
    parent to accept the run (on the run's live subject: a subscription per call)."""
    return await parent.run_agent_tool(AGENT, {"n": n}, run_id=run_id,
                                       detached={"on_finish": HOOK_METHOD})


async def _submit_publish(parent: ParentHandle, n: int, run_id: str) -> DetachedHandle:
    """Fire and forget (`--submit publish`): only the run command, no subscription and no
    wait for the acceptance; a rejection would show up as a W1 timeout."""
    command = build_run_command(parent.ref, AGENT, {"n": n}, run_id=run_id,
                                parent_tool_call_id=None, display_order=None, display=None,
                                detached={"on_finish": HOOK_METHOD})
    await parent.tether.publish_command("run", command, f"run:{run_id}")
    return DetachedHandle(run_id=run_id, agent_type=AGENT, status="running")


async def w1(tether: Tether, positions: Positions, services: ServiceSet, probe: Probe, *,
             runs: int, tag: str, submit_concurrency: int, hook_concurrency: int,
             parents: int, timeout: float, server_pids: dict[str, list[int]],
             submit_mode: str = "client", max_open: int = 0, on_started=None) -> dict:
    recorder = W1Recorder(runs)
    recorder.on_count[max(runs // 2, 1)] = lambda: services.sample("half")
    recorder.on_count.setdefault(max(3 * runs // 4, 1), lambda: services.sample("three_quarters"))
    recorder.on_count[runs] = lambda: services.sample("end")
    hooks = tether.hooks(PARENT_AGENT, concurrency=hook_concurrency)
    hooks.register(HOOK_METHOD, recorder.hook)
    instances = [tether.parent(PARENT_AGENT, f"bench-{p}") for p in range(parents)]
    rejected: list[str] = []
    accepted: list[str] = []
    failed: list[str] = []  # run_agent_tool raised
    requested_at: dict[str, float] = {}
    timeline: list[dict] = []
    services.sample("start")
    async with hooks.running(), probe:
        last_seq0, checkpoint0 = await positions.read()
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(_sampler(positions, services, recorder, timeline,
                                               stop_sampling))
        try:
            if on_started is not None:
                on_started()
            cpu = CpuMeter({**{n: [pid] for n, pid in services.pids().items()}, **server_pids,
                            "bench-app": [os.getpid()], "probe": [probe.pid]})
            cpu.start()
            counters = ServerCounters(positions.db, nats_server_pids(server_pids),
                                      positions.db_lock)
            await counters.start()
            numbers = iter(range(runs))
            submit = _submit_publish if submit_mode == "publish" else _submit_client

            async def submitter() -> None:
                for n in numbers:
                    while max_open and n - len(recorder.finished) >= max_open:
                        await recorder.progressed.wait()
                        recorder.progressed.clear()
                    run_id = f"{tag}-w1-{n}"
                    requested_at[run_id] = time.time()
                    try:
                        handle = await submit(instances[n % parents], n, run_id)
                    except Exception as error:  # noqa: BLE001 - counted and reported
                        failed.append(f"{run_id}: {type(error).__name__}: {error}")
                        recorder.expect_one_less()
                        continue
                    if not isinstance(handle, DetachedHandle) or handle.status != "running":
                        rejected.append(f"{run_id}: {handle}")
                    else:
                        accepted.append(run_id)

            started = time.time()
            await asyncio.gather(*(submitter() for _ in range(submit_concurrency)))
            submit_end = time.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(recorder.done.wait(),
                                       max(timeout - (submit_end - started), 1))
            finished_at = max(recorder.finished.values(), default=time.time())
            cpu_used = cpu.stop()
            last_seq_end, checkpoint_end = await positions.read()
            caught_up_at, last_seq_final, checkpoint_final = await positions.wait_caught_up(60)
        finally:
            stop_sampling.set()
            await sampler
        _fill_memory_samples(services, timeline, len(recorder.finished))
        work_per_run = await counters.per_run(len(recorder.finished))
        # Hooks still in flight: the ledger events of the last few land after the call.
        await asyncio.sleep(0.2)
        progress = await probe.stop()
    sampled = [(instances[int(run_id.rsplit("-", 1)[1]) % parents].ref, run_id,
                requested_at[run_id], seen) for run_id, seen in recorder.finished.items()]
    hooks = await stages.hook_times(tether, len(recorder.finished))
    hops = await stages.breakdown(tether, sampled, hooks=hooks)
    seconds = finished_at - started
    appended = last_seq_end - last_seq0
    projected = checkpoint_final - checkpoint0
    in_window = [lat for (t, lat, _) in progress if started <= t <= finished_at]
    return {
        "runs": runs, "finished": len(recorder.finished), "rejected": rejected[:5],
        "rejected_count": len(rejected), "submit_errors": len(failed),
        "submit_error_examples": failed[:3], "statuses": dict(recorder.statuses),
        "hook_calls": recorder.calls, "duplicate_hook_calls": recorder.calls - len(recorder.finished),
        "seconds": seconds, "runs_per_s": len(recorder.finished) / seconds if seconds > 0 else 0,
        "submit_seconds": submit_end - started,
        "submit_per_s": runs / max(submit_end - started, 1e-9),
        "events_appended": appended, "events_per_run": appended / max(len(recorder.finished), 1),
        "events_appended_per_s": appended / seconds if seconds > 0 else 0,
        "events_projected": projected,
        "events_projected_per_s": projected / max(caught_up_at - started, 1e-9),
        "projector_lag_end_events": max(last_seq_end - checkpoint_end, 0),
        "projector_catch_up_s": max(caught_up_at - finished_at, 0.0),
        "projector_caught_up": checkpoint_final >= last_seq_final,
        "progress_latency": latency_summary(in_window),
        "progress_signals": len(progress),
        "stages": hops,
        "max_open": max_open,
        "memory_timeline": _memory_timeline(timeline),
        "max_events_stream_consumers": max((p["consumers"] for p in timeline), default=0),
        "cpu_seconds": cpu_used,
        "server_work_per_run": work_per_run,
        "messages_per_run": {k: v / max(len(recorder.finished), 1) for k, v in
                             sorted(probe.subjects.items(), key=lambda kv: -kv[1])},
        "cpu_ms_per_run": {name: 1000 * used / max(len(recorder.finished), 1)
                           for name, used in cpu_used.items()
                           if not name.startswith(("machine_", "kernel:"))},
        "cpu_ms_per_run_by_service": _by_service(cpu_used, services.service_of(),
                                                 len(recorder.finished)),
        "replicas": {name: count for name, count in services.replicas.items()},
        "cpu_kernel_share": {name: cpu_used[f"kernel:{name}"] / used
                             for name, used in cpu_used.items()
                             if f"kernel:{name}" in cpu_used and used > 0},
        "cores_busy": {"all": cpu_used["machine_busy"] / max(seconds, 1e-9),
                       "others": cpu_used["others"] / max(seconds, 1e-9)},
        "_accepted": accepted, "_hook_calls": recorder.calls_by_run,
        "_series": {"started": started, "finished": sorted(recorder.finished.values()),
                    "progress": progress, "timeline": timeline},
    }


async def w2(tether: Tether, *, runs: int, tag: str) -> dict:
    me = tether.parent(PARENT_AGENT, "bench-awaited")
    seconds, failures, sampled = [], [], []
    for n in range(runs):
        begin, wall = time.perf_counter(), time.time()
        result = await me.run_agent_tool(AGENT, {"n": n}, run_id=f"{tag}-w2-{n}", timeout=60)
        seconds.append(time.perf_counter() - begin)
        sampled.append((me.ref, f"{tag}-w2-{n}", wall, wall + seconds[-1]))
        if not isinstance(result, AgentToolSuccess):
            failures.append(str(result))
    return {"runs": runs, "failures": len(failures), "failure_examples": failures[:3],
            "round_trip": latency_summary(seconds),
            "stages": await stages.breakdown(tether, sampled), "_series": {"seconds": seconds}}


REBUILT = re.compile(r"rebuilt \S+ from (\d+) events up to sequence (\d+) in ([\d.]+)s")


def rebuild(env: dict[str, str], batch_size: int | None = None) -> dict:
    """`tether projections rebuild` over the log W1 produced; its own figure and our clock."""
    command = [sys.executable, "-m", "tether.cli", "projections", "rebuild"]
    if batch_size:
        command += ["--batch-size", str(batch_size)]
    begin = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=1800, check=False)
    wall = time.perf_counter() - begin
    match = REBUILT.search(done.stdout)
    if done.returncode != 0 or not match:
        raise RuntimeError(f"rebuild failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-2000:]}")
    events, checkpoint, seconds = int(match[1]), int(match[2]), float(match[3])
    return {"events": events, "checkpoint": checkpoint, "seconds": seconds,
            "events_per_s": events / max(seconds, 1e-9), "wall_seconds": wall,
            "wall_events_per_s": events / max(wall, 1e-9),
            "digests": [line.strip() for line in done.stdout.splitlines() if "md5" in line]}
