"""The figures against their ceilings and targets: a table on stdout and a JSON file."""

import json
import math
import statistics
from pathlib import Path

from bench.peers.sweep import complete

# Each peer's reference configuration: as deployed by default (DBOS: workflows started
# directly in the application; Celery: one prefork worker, a process per CPU).
# Restate: its server's defaults, 24 partitions and its log synced.
PEER_REFERENCES = {"dbos": "direct", "celery": "default", "restate": "default"}
PEER_TITLES = {"dbos": "DBOS", "celery": "Celery", "restate": "Restate"}

GROWTH_TOLERANCE_KIB = 1024  # per quarter of the runs: RSS may wobble by a MiB
GROWTH_TOLERANCE_RATIO = 0.01


def memory_verdict(services: dict[str, dict[str, dict[str, int]]],
                   finished: int) -> dict[str, dict]:
    """Peak RSS and the growth between N/2 and N finished runs, per service.

    A service grows when its RSS rose in both quarters, N/2 -> 3N/4 and 3N/4 -> N, each
    by more than a MiB (or 1 %): memory held per finished run rises all the way. A
    single step in one quarter is the allocator keeping a burst's arenas (seen in the
    projector, whose traced Python heap stayed flat across 12,000 runs while its RSS
    stepped up once by 10 MiB); for a steady leak the rule is no less sensitive than
    2 MiB over the half. Without a 3N/4 sample the whole half must stay within 2 MiB.
    """
    result = {}
    for name, samples in services.items():
        half = samples.get("half", {}).get("VmRSS", 0)
        quarter = samples.get("three_quarters", {}).get("VmRSS")
        end = (samples.get("end") or samples.get("final") or {}).get("VmRSS", 0)
        peak = max((s.get("VmHWM", 0) for s in samples.values()), default=0)
        growth = end - half
        tolerance = max(GROWTH_TOLERANCE_KIB, GROWTH_TOLERANCE_RATIO * half)
        if quarter is None:
            grows = growth > 2 * tolerance
        else:
            grows = quarter - half > tolerance and end - quarter > tolerance
        result[name] = {"peak_kib": peak, "rss_start_kib": samples.get("start", {}).get("VmRSS", 0),
                        "rss_half_kib": half, "rss_three_quarters_kib": quarter,
                        "rss_end_kib": end, "growth_kib": growth,
                        "growth_kib_per_1k_runs": growth / max(finished / 2, 1) * 1000,
                        "grows": bool(grows)}
    return result


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def ratio(ours: float | None, ceiling: float | None) -> float | None:
    if not ours or not ceiling or math.isnan(ours) or math.isnan(ceiling):
        return None
    return ours / ceiling


def ratios(report: dict) -> dict:
    w1, ceil, rebuild = report["w1"], report.get("ceilings") or {}, report.get("rebuild") or {}
    return {
        "appended_vs_append_async": ratio(w1["events_appended_per_s"], ceil.get("append_async_per_s")),
        "appended_vs_append_sync": ratio(w1["events_appended_per_s"], ceil.get("append_sync_per_s")),
        "projected_vs_copy": ratio(w1["events_projected_per_s"], ceil.get("copy_rows_per_s")),
        "projected_vs_ordered_replay": ratio(w1["events_projected_per_s"],
                                             ceil.get("ordered_replay_per_s")),
        "rebuild_vs_fetch_ack": ratio(rebuild.get("events_per_s"), ceil.get("fetch_ack_per_s")),
        "rebuild_vs_ordered_replay": ratio(rebuild.get("events_per_s"),
                                           ceil.get("ordered_replay_per_s")),
        "rebuild_vs_copy": ratio(rebuild.get("events_per_s"), ceil.get("copy_rows_per_s")),
        **peer_ratios(w1["runs_per_s"], report.get("peers") or {}),
        **alternated_ratios(report.get("alternated")),
        **awaited_ratios((report.get("w2") or {}).get("round_trip") or {},
                         (report.get("peers") or {}).get("restate") or {}),
    }


def alternated_ratios(alternated: dict | None) -> dict:
    """`w1_vs_<peer>_alternated`: the median ratio of each peer's alternated pairs."""
    return {f"w1_vs_{peer}_alternated": paired["median_ratio"]
            for peer, paired in (alternated or {}).items()}


def restate_awaited(restate: dict) -> dict:
    """Restate's awaited calls at their best: of its best W1 configuration's run, the
    lower p50 and the lower p99 of its calls with and without an idempotency key."""
    best = restate.get("best") or {}
    calls = [w for w in (best.get("w2"), best.get("w2_unkeyed")) if w and "p50_ms" in w]
    if not calls:
        return {}
    return {"p50_ms": min(w["p50_ms"] for w in calls),
            "p99_ms": min(w["p99_ms"] for w in calls), "label": best.get("label")}


def awaited_ratios(round_trip: dict, restate: dict) -> dict:
    """`w2_p50_vs_restate`, `w2_p99_vs_restate`: Tether's awaited call's latency over
    Restate's (below 1: Tether's is shorter)."""
    theirs = restate_awaited(restate)
    if not theirs:
        return {}
    return {f"w2_{q}_vs_restate": ratio(round_trip.get(f"{q}_ms"), theirs[f"{q}_ms"])
            for q in ("p50", "p99")}


def peer_ratios(runs_per_s: float, peers: dict) -> dict:
    """Tether's W1 throughput over each peer's best configuration (`w1_vs_<peer>`) and over
    its reference one (`w1_vs_dbos_direct`, `w1_vs_celery_default`)."""
    result = {}
    for name, reference in PEER_REFERENCES.items():
        peer = peers.get(name) or {}
        result[f"w1_vs_{name}"] = ratio(runs_per_s, peer.get("runs_per_s"))
        result[f"w1_vs_{name}_{reference}"] = ratio(
            runs_per_s, (peer.get("reference") or {}).get("runs_per_s"))
    return result


# What an alternated pair keeps of Tether's W1: enough for its ratio and its verdict.
PAIR_W1_KEYS = ("runs", "finished", "runs_per_s", "cpu_ms_per_run", "correctness",
                "duplicate_hook_calls", "submit_errors", "crashed_services", "prefix")


def alternated(peer: str, pairs: list[dict]) -> dict:
    """Pairs of neighbouring runs, Tether's W1 and the peer's best configuration: each
    pair's ratio, and the median of the ratios of the pairs whose two runs both finished
    every run (`median_ratio`, None when no pair did)."""
    rows = []
    for pair in pairs:
        ours, theirs = pair["tether"], pair[peer]
        finished = ours["finished"] == ours["runs"] and complete(theirs)
        rows.append({"tether": {key: ours.get(key) for key in PAIR_W1_KEYS}, peer: theirs,
                     "ratio": ratio(ours["runs_per_s"], theirs["runs_per_s"])
                     if finished else None})
    ratios = [row["ratio"] for row in rows if row["ratio"] is not None]
    return {"peer": peer, "pairs": rows,
            "median_ratio": statistics.median(ratios) if ratios else None}


def _peer_figure(point: dict) -> str:
    cpu = point.get("cpu") or {}
    busy = (f"  (cores busy: machine {cpu['machine_cores_busy']:.2f}, the peer's processes "
            f"{cpu['peer_cores']:.2f})" if cpu else "")
    if complete(point):
        return f"{point['runs_per_s']:7.1f}{busy}"
    return f"incomplete {point.get('finished', 0)}/{point.get('runs')}{busy}"


def peers_table(report: dict) -> str:
    """Each peer's sweep, one line per configuration, and Tether's ratios to it."""
    lines = []
    for name, peer in (report.get("peers") or {}).items():
        title = PEER_TITLES.get(name, name)
        if not peer.get("sweep"):
            lines.append(f"{title}: failed: {peer.get('error', '')[-1500:]}")
            continue
        lines.append(f"{title} {peer.get('version', '')} W1, runs/s of "
                     f"{len(peer['sweep'])} configuration(s) at {peer['sweep_runs']} runs "
                     "(* the best):")
        best_config = (peer.get("best") or {}).get("config")
        width = max(40, *(len(point["label"]) for point in peer["sweep"]))
        for point in peer["sweep"]:
            mark = "*" if point["config"] == best_config else " "
            lines.append(f"  {mark} {point['label']:<{width}} {_peer_figure(point)}")
        for point in peer.get("confirmed") or []:
            lines.append(f"    {point['label'] + ' at ' + str(point['runs']) + ' runs':<{width}} "
                         f"{_peer_figure(point)}")
        if "error" in peer:
            lines.append(f"  failed: {peer['error']}")
            continue
        r, reference = report["ratios"], peer.get("reference") or {}
        ref_name = PEER_REFERENCES[name]
        lines.append(
            f"  Tether / {title} = {_x(r.get(f'w1_vs_{name}'))} of the best ({peer['label']}, "
            f"{peer['runs_per_s']:.1f} runs/s over {peer['runs']} runs); "
            f"{_x(r.get(f'w1_vs_{name}_{ref_name}'))} of the {ref_name} configuration "
            f"({reference.get('label', '-')}, {_n(reference.get('runs_per_s'), 1)} runs/s)")
        paired = (report.get("alternated") or {}).get(name)
        if paired:
            lines.append(f"  alternated, each pair one run after the other: "
                         f"{_x(paired['median_ratio'])} (the median of the pairs)")
            for n, pair in enumerate(paired["pairs"], 1):
                ours, theirs = pair["tether"], pair[name]
                figure = (f"{_n(theirs['runs_per_s'], 1)} runs/s" if complete(theirs) else
                          f"incomplete {theirs.get('finished', 0)}/{theirs.get('runs')}")
                lines.append(f"    pair {n}: Tether {_n(ours['runs_per_s'], 1)} runs/s "
                             f"({ours['finished']}/{ours['runs']}), {title} {figure}: "
                             f"{_x(pair['ratio'])}")
        if name == "restate":
            lines += _restate_lines(report, peer)
    return "\n".join(lines)


def _restate_lines(report: dict, restate: dict) -> list[str]:
    """Restate's awaited calls and CPU per run beside Tether's."""
    ours = (report.get("w2") or {}).get("round_trip") or {}
    theirs, r = restate_awaited(restate), report["ratios"]
    lines = []
    if theirs:
        lines.append(f"  awaited calls p50/p99: Tether {_n(ours.get('p50_ms'), 2)} / "
                     f"{_n(ours.get('p99_ms'), 2)} ms, Restate {_n(theirs['p50_ms'], 2)} / "
                     f"{_n(theirs['p99_ms'], 2)} ms ({theirs['label']}); Tether's over "
                     f"Restate's {_x(r.get('w2_p50_vs_restate'))} / "
                     f"{_x(r.get('w2_p99_vs_restate'))}")
    cpu = (restate.get("best") or {}).get("cpu_ms_per_run")
    if cpu:
        tether_cpu = sum(ms for name, ms in (report["w1"].get("cpu_ms_per_run") or {}).items()
                         if name not in ("others", "probe"))
        lines.append(f"  CPU ms per W1 run: Tether {_n(tether_cpu, 2)} (its services, NATS, "
                     f"Postgres and the bench app; not the probe), Restate {_n(cpu['all'], 2)} (server "
                     f"{_n(cpu['restate-server'], 2)}, SDK workers {_n(cpu['sdk-workers'], 2)}, "
                     f"driver {_n(cpu['driver'], 2)})")
    return lines


# The options that load the machine to look inside a run: with one of them, the run's
# times, latencies and CPU figures are not comparable with other runs', and no target is
# judged.
DIAGNOSTIC_OPTIONS = {
    "count_subjects": "--count-subjects (a subscriber to every subject doubles the server's "
                      "fan-out, and the progress probe counts every message)",
    "callgrind": "--callgrind (a service under valgrind)",
}


def diagnostic(report: dict) -> list[str]:
    """The diagnostic options the run was made with (`DIAGNOSTIC_OPTIONS`)."""
    params = (report.get("meta") or {}).get("params") or {}
    return [text for name, text in DIAGNOSTIC_OPTIONS.items() if params.get(name)]


def targets(report: dict) -> dict:
    w1, w2, r = report["w1"], report.get("w2") or {}, report["ratios"]
    memory = report.get("memory") or {}
    judged = not diagnostic(report)

    def target(value, goal: str, met) -> dict:
        return {"value": value, "target": goal,
                "met": None if met is None or not judged else bool(met)}

    dbos = r.get("w1_vs_dbos")
    restate = r.get("w1_vs_restate_alternated") or r.get("w1_vs_restate")
    rebuild = r.get("rebuild_vs_fetch_ack")
    w2_p50 = (w2.get("round_trip") or {}).get("p50_ms")
    return {
        "w1_runs_per_s": target(w1["runs_per_s"], ">= 500", w1["runs_per_s"] >= 500),
        "w1_vs_dbos": target(dbos, ">= 10x the best DBOS configuration",
                             None if dbos is None else dbos >= 10),
        "w1_vs_restate": target(restate, ">= 2x the best Restate configuration (the median "
                                "of the alternated pairs where they ran)",
                                None if restate is None else restate >= 2),
        **{f"w2_{q}_vs_restate": target(r.get(f"w2_{q}_vs_restate"),
                                        f"<= 1x Restate's awaited call {q}",
                                        None if r.get(f"w2_{q}_vs_restate") is None
                                        else r[f"w2_{q}_vs_restate"] <= 1)
           for q in ("p50", "p99")},
        "progress_p99_ms": target(w1["progress_latency"]["p99_ms"], "< 50",
                                  w1["progress_latency"]["p99_ms"] < 50),
        "w2_p50_ms": target(w2_p50, "< 20", None if w2_p50 is None else w2_p50 < 20),
        "rebuild_vs_consume": target(rebuild, ">= 0.5 of fetch+ack",
                                     None if rebuild is None else rebuild >= 0.5),
        "no_memory_growth": target([n for n, m in memory.items() if m["grows"]], "none grows",
                                   not any(m["grows"] for m in memory.values()) if memory else None),
    }


def strip_series(value):
    """The report without the raw series (kept in the chart, not the JSON)."""
    if isinstance(value, dict):
        return {k: strip_series(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [strip_series(v) for v in value]
    return value


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(strip_series(report), indent=2, default=str) + "\n")


def _n(value, digits: int = 0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(report: dict) -> str:
    w1, w2, c = report["w1"], report.get("w2") or {}, report.get("ceilings") or {}
    rb, r, t = report.get("rebuild") or {}, report["ratios"], report["targets"]
    pl, rt = w1["progress_latency"], w2.get("round_trip") or {}
    w2_mcp = report.get("w2_mcp") or {}
    mt = w2_mcp.get("round_trip") or {}
    rows = []
    if options := diagnostic(report):
        rows.append(("diagnostic run", "not comparable",
                     (f"{'; '.join(options)}: its times, latencies and CPU figures are not "
                      "comparable with other runs', and no target is judged")))
    rows += [
        ("W1 runs", f"{w1['finished']}/{w1['runs']}", (f"statuses {w1['statuses']}, submit errors {w1.get('submit_errors', 0)}, "
         f"rejected {w1['rejected_count']}, duplicate hook calls {w1['duplicate_hook_calls']}; "
         f"up to {w1.get('max_events_stream_consumers', '-')} consumers on the events stream")),
        ("W1 throughput", _n(w1["runs_per_s"], 1, " runs/s"),
         (f"{_n(w1['seconds'], 2)} s; submit {_n(w1['submit_per_s'], 0)}/s; vs the best DBOS "
          f"{_x(r['w1_vs_dbos'])}, the best Celery {_x(r['w1_vs_celery'])}, the best Restate "
          f"{_x(r['w1_vs_restate'])}")),
        ("events appended", _n(w1["events_appended_per_s"], 0, "/s"),
         (f"{w1['events_appended']} events ({w1['events_per_run']:.1f}/run); "
         f"{_x(r['appended_vs_append_async'])} of async append, {_x(r['appended_vs_append_sync'])} of sync")),
        ("events projected", _n(w1["events_projected_per_s"], 0, "/s"),
         (f"{_x(r['projected_vs_copy'])} of COPY; lag at end {w1['projector_lag_end_events']} events, "
         f"caught up {_n(w1['projector_catch_up_s'], 2)} s later")),
        ("progress latency", f"p50 {_n(pl['p50_ms'], 1)} ms", (f"p99 {_n(pl['p99_ms'], 1)} ms, "
         f"max {_n(pl['max_ms'], 1)} ms over {pl['count']} signals")),
        ("W2 round trip", f"p50 {_n(rt.get('p50_ms'), 1)} ms",
         f"p99 {_n(rt.get('p99_ms'), 1)} ms over {w2.get('runs', 0)} awaited runs"),
        ("W2 over MCP", f"p50 {_n(mt.get('p50_ms'), 1)} ms",
         (f"p99 {_n(mt.get('p99_ms'), 1)} ms over {w2_mcp.get('runs', 0)} tool calls through "
          f"the gateway, {w2_mcp.get('failures', 0)} failed")),
        ("rebuild", _n(rb.get("events_per_s"), 0, " ev/s"),
         (f"{rb.get('events', '-')} events in {_n(rb.get('seconds'), 2)} s; "
         f"{_x(r['rebuild_vs_fetch_ack'])} of fetch+ack, {_x(r['rebuild_vs_ordered_replay'])} of replay")),
        ("ceil: append", _n(c.get("append_async_per_s"), 0, "/s"),
         f"async, {c.get('append_in_flight', '-')} in flight; sync {_n(c.get('append_sync_per_s'), 0)}/s"),
        ("ceil: consume", _n(c.get("fetch_ack_per_s"), 0, "/s"),
         (f"fetch+ack (batch {c.get('fetch_batch', '-')}); ordered replay "
         f"{_n(c.get('ordered_replay_per_s'), 0)}/s")),
        ("ceil: COPY", _n(c.get("copy_rows_per_s"), 0, " rows/s"),
         f"{c.get('messages', '-')} rows of {_n(c.get('mean_bytes'), 0)} B"),
    ]
    rows.append(("W1 correctness", correctness_summary(w1.get("correctness")),
                 ("no run lost, per-run order kept, one child turn and one finish hook per "
                  "run, from the log (bench/correctness.py)")))
    per_run = w1.get("cpu_ms_per_run") or {}
    busy = w1.get("cores_busy") or {}
    kernel = w1.get("cpu_kernel_share") or {}
    rows.append(("CPU ms per run", _n(sum(per_run.values()), 1, " ms"),
                 ", ".join(f"{k} {v:.1f}" + (f" ({kernel[k]:.0%} kernel)" if k in kernel else "")
                           for k, v in sorted(per_run.items(), key=lambda kv: -kv[1]))))
    rows.append(("cores busy in W1", _n(busy.get("all"), 2),
                 (f"of {report['meta']['cpus']}; others' processes {_n(busy.get('others'), 2)} "
                 "(noise: other work on the machine)")))
    if report.get("events_stream_leader"):
        rows.append(("events stream leader", report["events_stream_leader"],
                     ("the cluster's node that takes every append of the events stream "
                      "(node nK is nats-server-(K+1) above)")))
    work = w1.get("server_work_per_run") or {}
    if work:
        rows.append(("server work/run", f"{_n(work.get('nats_msgs_in'), 1)} msgs in",
                     (f"NATS out {_n(work.get('nats_msgs_out'), 1)}, JetStream API calls "
                      f"{_n(work.get('jetstream_api_calls'), 1)}; Postgres commits "
                      f"{_n(work.get('pg_xact_commit'), 2)}, rows ins/upd "
                      f"{_n(work.get('pg_tup_inserted'), 1)}/{_n(work.get('pg_tup_updated'), 1)}")))
    if cg := report.get("callgrind"):
        rows.append((f"instr {cg['service']}", f"{cg['per_run'] / 1e6:.2f} M/run",
                     (f"callgrind: {cg['instructions']:,} instructions over {cg['runs']} W1 runs, "
                      f"dumped once the service was quiet ({_n(cg.get('quiet_after_s'), 1)} s after W1) "
                      "(this run's times and throughput are not comparable: the service ran "
                      f"under valgrind); {cg['dump']}")))
    for name, m in (report.get("memory") or {}).items():
        rows.append((f"mem {name}", f"{m['peak_kib'] / 1024:.1f} MiB peak",
                     (f"RSS {m['rss_half_kib'] / 1024:.1f} -> {_mib(m.get('rss_three_quarters_kib'))}"
                      f" -> {m['rss_end_kib'] / 1024:.1f} MiB at N/2, 3N/4, N ({m['growth_kib_per_1k_runs']:+,.0f} KiB per 1k runs): "
                     f"{'GROWS' if m['grows'] else 'flat'}")))
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{name:<{width}}  {value:>16}  {detail}" for name, value, detail in rows]
    lines.append("")
    lines.append("targets: " + "; ".join(
        f"{name} {'MET' if v['met'] else ('n/a' if v['met'] is None else 'missed')}"
        for name, v in t.items()))
    return "\n".join(lines)


def correctness_summary(verdict: dict | None) -> str:
    if verdict is None:
        return "-"
    return "ok" if verdict["ok"] else "FAILED"


def correctness_failures(verdict: dict) -> str:
    """Each violated check with its count and examples, for the failure message."""
    parts = []
    for check, count in verdict["violations"].items():
        if count:
            parts.append(f"{check} {count} (e.g. " + "; ".join(verdict["examples"][check]) + ")")
    return ", ".join(parts)


def replicas_table(report: dict) -> str:
    """The replicated W1 beside the single-replica one: throughput, correctness and the
    CPU per run of each service (its replicas summed, each replica in brackets)."""
    single, replicated = report["w1"], report["w1_replicated"]
    replicas = replicated["replicas"]
    lines = [(f"W1 with {replicas['parent']} parents and {replicas['child-runner']} "
              "child-runners (a prefix of its own), beside the W1 above:"),
             f"  {'':<22} {'single':>10} {'replicated':>12}"]

    def row(name: str, one: str, many: str, detail: str = "") -> None:
        lines.append(f"  {name:<22} {one:>10} {many:>12}  {detail}".rstrip())

    row("runs finished", f"{single['finished']}/{single['runs']}",
        f"{replicated['finished']}/{replicated['runs']}")
    row("throughput, runs/s", _n(single["runs_per_s"], 1), _n(replicated["runs_per_s"], 1))
    verdict = replicated["correctness"]
    row("correctness", correctness_summary(single.get("correctness")),
        correctness_summary(verdict),
        f"{verdict['events']} events of {verdict['runs']} runs, "
        f"{verdict['conditional_appends']} of them appended expecting a sequence")
    if not verdict["ok"]:
        lines.append("    " + correctness_failures(verdict))
    split = replicated.get("run_commands_per_parent") or {}
    row("work split", "", "", "run commands handled per parent: "
        + (" / ".join(str(split[p]) for p in sorted(split)) or "-")
        + "; runs begun per child-runner: "
        + " / ".join(str(count) for _, count in sorted(verdict["runners"].items())))
    one, many = single["cpu_ms_per_run_by_service"], replicated["cpu_ms_per_run_by_service"]
    per_process = replicated["cpu_ms_per_run"]

    def ours(figures: dict) -> float:
        return sum(v for k, v in figures.items() if k != "others")

    row("CPU ms per run, ours", _n(ours(one), 2), _n(ours(many), 2),
        "every process below but the rest of the machine")
    for name in sorted(many, key=lambda k: (k == "others", -many[k])):
        processes = sorted(p for p in per_process if p.startswith(f"{name}-"))
        detail = ("(" + " + ".join(f"{p} {per_process[p]:.2f}" for p in processes) + ")"
                  if processes else "")
        if name == "others":
            detail = "the rest of the machine (other work on it: noise)"
        row(f"  {name}", _n(one.get(name), 2), _n(many[name], 2), detail)
    busy_one, busy_many = single.get("cores_busy") or {}, replicated.get("cores_busy") or {}
    row("cores busy (others)", f"{_n(busy_one.get('all'), 2)} ({_n(busy_one.get('others'), 2)})",
        f"{_n(busy_many.get('all'), 2)} ({_n(busy_many.get('others'), 2)})",
        f"of {report['meta']['cpus']}")
    return "\n".join(lines)
