"""`make bench` / `make bench-peers`: Tether's throughput and latency against the ceilings.

    python -m bench.run [--runs 5000] [--w2-runs 200] [--profile] [--peers] ...

Starts its own NATS and Postgres through scripts/devstack.py (or uses TETHER_NATS_URL /
TETHER_DATABASE_URL), the four services as processes with the bench child, runs W1, W2,
the rebuild and the ceilings, and writes bench/results/<timestamp>.json and .png.
"""

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import nats

from bench import ceilings, chart, report, stages
from bench.callgrind import Callgrind
from bench.correctness import verify_w1
from bench.gateway import gateway_w2
from bench.peers.sweep import complete, run_point
from bench.profile import Profiler, render
from bench.stack import LAYOUTS, PROCESSES, REPO, ServiceSet, server_pids, servers
from bench.workloads import HOOK_METHOD, Positions, Probe, rebuild, w1, w2
from tether.adapters.streams import remove_streams
from tether.cli import event_loop_factory
from tether.client import Tether, connect
from tether.config import Settings
from tether.log import configure_logging
from tether.runtime import tune_gc

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("dbos", "celery", "restate")
# The peers Tether's W1 is alternated with, in pairs, after the sweeps.
ALTERNATED = ("dbos", "restate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5000, help="W1 detached runs (default 5000)")
    parser.add_argument("--w2-runs", type=int, default=200, help="W2 awaited runs (default 200)")
    parser.add_argument("--submit-concurrency", type=int, default=64,
                        help="W1 run requests in flight from the bench app (default 64)")
    parser.add_argument("--submit", choices=["client", "publish"], default="client",
                        help="client: run_agent_tool(detached=...) as an app would (default); "
                             "publish: only publish the run commands (no wait for acceptance)")
    parser.add_argument("--max-open", type=int, default=1000,
                        help="at most this many W1 runs requested and not yet finished "
                             "(default 1000: enough to keep the machine saturated, and a "
                             "bounded backlog, so the memory readings at N/2, 3N/4 and N "
                             "compare finished runs rather than a backlog that grows when "
                             "requests outpace the services; 0: no cap)")
    parser.add_argument("--hook-concurrency", type=int, default=32,
                        help="the app's finish-hook handler concurrency (default 32)")
    parser.add_argument("--parents", type=int, default=16,
                        help="parent instances the W1 runs are spread over (default 16)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="after W1, run it again with this many parent and child-runner "
                             "processes (one projector and one reconciler), under a prefix of "
                             "its own, and report its CPU per run beside the single-replica "
                             "W1's (default 1: no second W1; --profile and --callgrind watch "
                             "the first W1 only)")
    parser.add_argument("--nats-nodes", type=int, default=1,
                        help="run everything on a cluster of this many nats-servers (each "
                             "its own process and store on this machine) with streams of as "
                             "many replicas (default 1: one nats-server; with "
                             "$TETHER_NATS_URL, the replicas only, on that NATS)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="give up on W1 after this many seconds (default 60 + runs/20)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy record every service during W1; hot spots in the report")
    parser.add_argument("--followers", choices=sorted(LAYOUTS), default="together",
                        help="the projector and the reconciler in one process, the "
                             "reconciler taking what the projector commits (together, the "
                             "default), or each in a process of its own (apart)")
    parser.add_argument("--callgrind", choices=PROCESSES, metavar="SERVICE",
                        help="run SERVICE (a process of the --followers layout: "
                             "projector,reconciler when together) under valgrind's callgrind and report the "
                             "instructions it executes per W1 run: a measure of its CPU work "
                             "that the machine's speed does not change (the run's times are "
                             "then meaningless; bench/callgrind.py)")
    parser.add_argument("--count-subjects", action="store_true",
                        help="count every NATS message by subject kind during W1 (diagnosis; "
                             "adds load)")
    parser.add_argument("--peers", action="store_true",
                        help="also run W1 on the peers, DBOS, Celery and Restate, each swept "
                             "over its configurations, and compare Tether with the best "
                             "(make bench-peers)")
    parser.add_argument("--peer", action="append", choices=PEERS, dest="peer_names",
                        help="with --peers, only this peer (repeatable; default: all)")
    parser.add_argument("--peer-sweep-runs", type=int, default=400,
                        help="runs per configuration of a peer's sweep; its best and its "
                             "reference configuration are then run with --runs (default 400)")
    parser.add_argument("--peer-grid", choices=["default", "quick"], default="default",
                        help="the peers' configurations: default, or quick (two DBOS "
                             "configurations, one Celery, two Restate; for tests)")
    parser.add_argument("--peer-pairs", type=int, default=3,
                        help="with --peers, after the sweeps: Tether's W1 and DBOS's best "
                             "configuration, then Tether's W1 and Restate's best, run one "
                             "after the other this many times, each "
                             "with --runs, and the median of the pairs' ratios reported "
                             "(default 3; 0: none)")
    parser.add_argument("--redis-url", default=os.environ.get("TETHER_BENCH_REDIS_URL"),
                        help="the Redis of the Celery peer (default: $TETHER_BENCH_REDIS_URL, "
                             "else a throwaway redis-server on a free port)")
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--no-rebuild", action="store_true")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="the event loop of the services (TETHER_EVENT_LOOP), the bench "
                             "application and the probe (default: uvloop)")
    parser.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the services, e.g. TETHER_RUNNER_CONCURRENCY=64")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--keep", action="store_true",
                        help="keep the streams and schemas of this run (default: deleted)")
    args = parser.parse_args(argv)
    if args.callgrind and args.callgrind not in LAYOUTS[args.followers]:
        parser.error(f"--callgrind {args.callgrind}: not a process of --followers "
                     f"{args.followers} ({', '.join(LAYOUTS[args.followers])})")
    return args


def git_describe() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def peer_args(name: str, database_url: str) -> list[str]:
    """Restate keeps its own store; the other peers' rows go to the bench's Postgres."""
    return [] if name == "restate" else ["--database-url", database_url]


def run_peer(name: str, args: argparse.Namespace, database_url: str) -> dict:
    """`bench/peers/<name>_w1.py` in its own process: its sweep, as JSON.

    Its progress (one line per configuration) goes to stderr as it runs."""
    command = [sys.executable, "-m", f"bench.peers.{name}_w1", *peer_args(name, database_url),
               "--runs", str(args.runs), "--sweep-runs", str(args.peer_sweep_runs),
               "--grid", args.peer_grid, "--json"]
    if name == "celery" and args.redis_url:
        command += ["--redis-url", args.redis_url]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    for line in process.stderr:
        print(line, end="", file=sys.stderr, flush=True)
        tail = [*tail, line][-30:]
    out = process.stdout.read()
    if process.wait() != 0 or not out.strip():
        return {"system": name, "error": ("".join(tail) or out)[-1500:]}
    return json.loads(out.strip().splitlines()[-1])


async def cleanup(nats_url: str, database_url: str, settings: Settings) -> None:
    nc = await nats.connect(nats_url.split(","))
    await remove_streams(nc.jetstream(), settings.subjects)
    await nc.drain()
    conn = await asyncpg.connect(database_url)
    try:
        schemas = await conn.fetch("SELECT nspname FROM pg_namespace WHERE nspname LIKE $1",
                                   settings.projection_schema + "%")
        for row in schemas:
            await conn.execute(f'DROP SCHEMA "{row["nspname"]}" CASCADE')
    finally:
        await conn.close()


async def run_w1(args: argparse.Namespace, tether: Tether, positions: Positions,
                 services: ServiceSet, probe: Probe, *, tag: str, nats_url: str,
                 database_url: str, timeout: float, on_started=None) -> dict:
    """W1, then its correctness, checked from the log (bench/correctness.py)."""
    result = await w1(tether, positions, services, probe, runs=args.runs, tag=tag,
                      submit_concurrency=args.submit_concurrency,
                      hook_concurrency=args.hook_concurrency, parents=args.parents,
                      timeout=timeout, server_pids=server_pids(nats_url, database_url),
                      submit_mode=args.submit, max_open=args.max_open, on_started=on_started)
    result["correctness"] = await verify_w1(tether.log, accepted=result["_accepted"],
                                            hook_calls=result["_hook_calls"],
                                            hook_method=HOOK_METHOD)
    return result


async def fresh_w1(args: argparse.Namespace, nats_url: str, database_url: str,
                   extra: dict[str, str], log_dir: Path,
                   replicas: dict[str, int] | None = None) -> dict:
    """W1 on services started for it, under a prefix and schema of its own, so its log
    holds its runs alone. With `replicas`, also the run commands each parent handled."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"bench{tag}"
    settings = Settings(nats_url=nats_url, database_url=database_url, prefix=prefix,
                        projection_schema=prefix, stream_replicas=args.nats_nodes)
    env = ServiceSet.environment(nats_url, database_url, prefix, extra)
    services = ServiceSet(env, log_dir, replicas=replicas, followers=args.followers)
    await services.start()
    try:
        async with connect(settings=settings, name="tether-bench") as tether:
            db = await asyncpg.connect(database_url)
            try:
                positions = Positions(tether, db, prefix)
                probe = Probe(nats_url, prefix, log_dir / ".probe.tmp", args.count_subjects,
                              args.event_loop)
                result = await run_w1(args, tether, positions, services, probe, tag=tag,
                                      nats_url=nats_url, database_url=database_url,
                                      timeout=args.timeout or 60 + args.runs / 20)
                if replicas:
                    result["run_commands_per_parent"] = await services.commands_handled(
                        "parent", "command.run")
            finally:
                await db.close()
    finally:
        crashed = services.crashed()
        exit_codes = await services.stop()
        if not args.keep:
            await cleanup(nats_url, database_url, settings)
    result.update(prefix=prefix, crashed_services=crashed, exit_codes=exit_codes,
                  logs=str(log_dir))
    return result


async def replicated_w1(args: argparse.Namespace, nats_url: str, database_url: str,
                        extra: dict[str, str], log_dir: Path) -> dict:
    """W1 again with `--replicas` parents and child-runners (the projector and the
    reconciler one each, as in the first W1)."""
    return await fresh_w1(args, nats_url, database_url, extra, log_dir,
                          replicas={"parent": args.replicas, "child-runner": args.replicas})


async def alternated(args: argparse.Namespace, nats_url: str, database_url: str,
                     extra: dict[str, str], log_dir: Path, peer: str, best: dict,
                     run_peer: Callable[[dict, int], dict] | None = None) -> dict:
    """Tether's W1 and the peer's best configuration run one after the other,
    `--peer-pairs` times, each with the bench's runs (`run_peer(config, runs)`, by
    default `bench/peers/<peer>_w1.py` as its own process).

    The machine's speed drifts by a third within minutes, and the first W1 ran minutes
    before the peer's sweep: a ratio of two runs far apart measures the drift as much
    as the systems. Each pair's two runs are neighbours, so the drift moves both."""
    if run_peer is None:
        def run_peer(config: dict, runs: int) -> dict:
            return run_point(f"bench.peers.{peer}_w1", config, runs,
                             peer_args(peer, database_url))
    pairs = []
    for n in range(1, args.peer_pairs + 1):
        ours = await fresh_w1(args, nats_url, database_url, extra, log_dir / f"pair-{n}")
        theirs = await asyncio.to_thread(run_peer, best["config"], args.runs)
        pairs.append({"tether": ours, peer: theirs})
        print(f"{peer} pair {n}: Tether {ours['runs_per_s']:.1f} runs/s, {theirs['label']} "
              f"{theirs.get('runs_per_s', 0):.1f} runs/s", file=sys.stderr, flush=True)
    return report.alternated(peer, pairs)


async def measure_offline(args: argparse.Namespace, result: dict, env: dict[str, str],
                          settings: Settings) -> None:
    """What runs with Tether's services stopped: the rebuild, the ceilings, the peers."""
    if not args.no_rebuild:
        result["rebuild"] = await asyncio.to_thread(rebuild, env)
    if not args.no_ceilings:
        result["ceilings"] = await ceilings.measure(settings.nats_url, settings.database_url,
                                                    settings.subjects, result["log_messages"],
                                                    replicas=settings.stream_replicas)
    if args.peers:
        result["peers"] = {name: await asyncio.to_thread(run_peer, name, args,
                                                         settings.database_url)
                           for name in args.peer_names or PEERS}


def failures(result: dict) -> list[str]:
    """Why the bench exits with 1: a W1 run did not finish, a hook ran twice, a request
    failed, a service crashed, or the log shows a W1 that was not correct."""
    found = []
    checked = [("W1", result["w1"]), ("replicated W1", result.get("w1_replicated")),
               *((f"alternated W1 {n} ({peer})", pair["tether"])
                 for peer, paired in (result.get("alternated") or {}).items()
                 for n, pair in enumerate(paired["pairs"], 1))]
    for name, w in checked:
        if w is None:
            continue
        if w["finished"] != w["runs"]:
            found.append(f"{name}: {w['finished']} of {w['runs']} runs finished")
        if w["duplicate_hook_calls"] or w.get("submit_errors"):
            found.append(f"{name}: {w['duplicate_hook_calls']} duplicate hook calls, "
                         f"{w.get('submit_errors')} failed requests")
        if not w["correctness"]["ok"]:
            found.append(f"{name} IS NOT CORRECT: "
                         + report.correctness_failures(w["correctness"]))
    crashed = result["crashed_services"] + [
        name for _, w in checked[1:] if w is not None for name in w["crashed_services"]]
    if crashed:
        found.append(f"crashed services: {', '.join(crashed)}")
    return found


async def bench(args: argparse.Namespace, nats_url: str, database_url: str) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = uuid.uuid4().hex[:8]
    prefix = f"bench{tag}"
    settings = Settings(nats_url=nats_url, database_url=database_url, prefix=prefix,
                        projection_schema=prefix, stream_replicas=args.nats_nodes)
    extra = {"TETHER_EVENT_LOOP": args.event_loop,
             "TETHER_STREAM_REPLICAS": str(args.nats_nodes),
             **dict(item.split("=", 1) for item in args.service_env)}
    env = ServiceSet.environment(nats_url, database_url, prefix, extra)
    out_dir = args.results_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    services = ServiceSet(env, out_dir / f"{stamp}-logs", followers=args.followers)
    result: dict = {"meta": {
        "timestamp": stamp, "git": git_describe(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(), "prefix": prefix,
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "service_env": extra,
        "note": "numbers are only comparable on an otherwise idle machine"}}
    profiler = Profiler(out_dir / f"{stamp}-profile") if args.profile else None
    timeout = args.timeout or 60 + args.runs / 20
    callgrind = None
    if args.callgrind:
        callgrind = Callgrind(args.callgrind, out_dir / f"{stamp}-{args.callgrind}.callgrind")
        services.wrappers[args.callgrind] = callgrind.command_prefix()
        timeout = args.timeout or 120 + args.runs / 2
    await services.start(timeout=300 if callgrind else 60)
    try:
        async with connect(settings=settings, name="tether-bench") as tether:
            db = await asyncpg.connect(database_url)
            try:
                positions = Positions(tether, db, prefix)
                # The application's collector tuned as the services' are: with Python's
                # defaults its full collections (150 ms once W1's records piled up)
                # stalled its hook handling and submissions.
                tune_gc(settings.gc_threshold)
                probe = Probe(nats_url, prefix, out_dir / f".{stamp}-probe.tmp",
                              args.count_subjects, args.event_loop)

                def started() -> None:
                    if profiler:
                        profiler.start(services.pids())
                    if callgrind:
                        callgrind.zero(services.pids()[callgrind.service])
                try:
                    result["w1"] = await run_w1(args, tether, positions, services, probe,
                                                tag=tag, nats_url=nats_url,
                                                database_url=database_url, timeout=timeout,
                                                on_started=started)
                finally:
                    if profiler:
                        result["profiles"] = profiler.stop()
                if callgrind:
                    total = await asyncio.to_thread(callgrind.dump)
                    runs = result["w1"]["finished"]
                    result["callgrind"] = {"service": callgrind.service, "instructions": total,
                                           "runs": runs, "per_run": total / max(runs, 1),
                                           "quiet_after_s": round(callgrind.quiet_after_s, 1),
                                           "dump": str(callgrind.out_file) + ".*"}
                await asyncio.sleep(1.0)  # W2 on an idle system
                if args.w2_runs:
                    result["w2"] = await w2(tether, runs=args.w2_runs, tag=tag)
                    result["w2_mcp"] = await gateway_w2(env, out_dir / f"{stamp}-logs",
                                                        runs=args.w2_runs, tag=tag)
                await positions.wait_caught_up(60)
                services.sample("final")
                result["memory"] = report.memory_verdict(
                    {n: s.samples for n, s in services.services.items()},
                    result["w1"]["finished"])
                events = await tether.js.stream_info(settings.subjects.events_stream)
                result["log_messages"] = events.state.messages
                # A cluster's node that takes every append of the events stream (a single
                # server names itself too: only a replicated stream's is reported).
                result["events_stream_leader"] = (events.cluster.leader if events.cluster
                                                  and events.cluster.replicas else None)
            finally:
                await db.close()
    finally:
        result["crashed_services"] = services.crashed()
        result["exit_codes"] = await services.stop()
    if args.replicas > 1:
        result["w1_replicated"] = await replicated_w1(args, nats_url, database_url, extra,
                                                      out_dir / f"{stamp}-replicas-logs")
    await measure_offline(args, result, env, settings)
    for peer in ALTERNATED:
        best = ((result.get("peers") or {}).get(peer) or {}).get("best")
        if args.peer_pairs and best is not None and complete(best):
            result.setdefault("alternated", {})[peer] = await alternated(
                args, nats_url, database_url, extra, out_dir / f"{stamp}-pairs-{peer}-logs",
                peer, best)
    if not args.keep:
        await cleanup(nats_url, database_url, settings)
    result["meta"]["load_avg_after"] = os.getloadavg()
    result["ratios"] = report.ratios(result)
    result["targets"] = report.targets(result)
    json_path = out_dir / f"{stamp}.json"
    png_path = None if args.no_chart else chart.draw(result, out_dir / f"{stamp}.png")
    result["files"] = {"json": str(json_path), "png": str(png_path) if png_path else None,
                       "logs": str(services.log_dir)}
    report.write_json(result, json_path)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("warning")  # the bench app's own hook handler logs per message at info
    loop_factory = event_loop_factory(args.event_loop)
    with servers(args.nats_nodes) as (nats_url, database_url), asyncio.Runner(loop_factory=loop_factory) as runner:
        result = runner.run(bench(args, nats_url, database_url))
    print(report.table(result))
    print("\nwhere a run's time goes, p50/p99 ms (from the events' occurred_at):")
    print("  W1: " + stages.render(result["w1"]["stages"]))
    if result.get("w2"):
        print("  W2: " + stages.render(result["w2"]["stages"]))
    if result["w1"].get("messages_per_run"):
        print("\nNATS messages per W1 run by subject: " + ", ".join(
            f"{k} {v:.1f}" for k, v in result["w1"]["messages_per_run"].items()))
    if "profiles" in result:
        print("\nhot spots (py-spy, share of busy samples):")
        print(render(result["profiles"]))
    if result.get("w1_replicated"):
        print("\n" + report.replicas_table(result))
    if result.get("peers"):
        print("\n" + report.peers_table(result))
    print(f"\n{result['files']['json']}" + (f"\n{result['files']['png']}"
                                           if result['files']['png'] else ""))
    for example in result["w1"].get("submit_error_examples") or []:
        print(f"submit error: {example}")
    found = failures(result)
    for failure in found:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
