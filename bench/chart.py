"""The PNG beside the JSON: throughput and latency of one benchmark run (matplotlib)."""

from pathlib import Path


def draw(report: dict, path: Path) -> Path | None:
    """Six panels; returns None (and draws nothing) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the `bench` extra
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use, as it asks

    w1 = report["w1"]
    series = w1["_series"]
    t0 = series["started"]
    finished = [t - t0 for t in series["finished"]]
    timeline = series["timeline"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    fig.suptitle(f"Tether bench {report['meta']['timestamp']}: W1 {w1['finished']} runs at "
                 f"{w1['runs_per_s']:.0f} runs/s ({report['meta']['git']})", fontsize=11)

    ax = axes[0][0]
    ax.plot(finished, range(1, len(finished) + 1), color="tab:blue")
    ax.set_title("W1 finish hooks handled (cumulative)")
    ax.set_xlabel("s since first request")
    ax.set_ylabel("runs")
    if finished:
        ax2 = ax.twinx()
        width = max(finished[-1] / 40, 0.05)
        ax2.hist(finished, bins=max(int(finished[-1] / width), 1), color="tab:orange", alpha=0.35)
        ax2.set_ylabel(f"runs per {width:.2f} s bin", color="tab:orange")

    ax = axes[0][1]
    ts = [s["t"] - t0 for s in timeline]
    if timeline:
        base_seq = timeline[0]["last_seq"]
        ax.plot(ts, [s["last_seq"] - base_seq for s in timeline], label="appended")
        ax.plot(ts, [s["checkpoint"] - base_seq for s in timeline], label="projected")
        ax.legend()
    ax.set_title("events appended vs projected")
    ax.set_xlabel("s since first request")

    ax = axes[0][2]
    for name in (timeline[0]["rss_kib"] if timeline else {}):
        ax.plot(ts, [s["rss_kib"].get(name, 0) / 1024 for s in timeline], label=name)
    if timeline:
        ax.legend(fontsize=8)
    ax.set_title("service RSS (MiB)")
    ax.set_xlabel("s since first request")

    ax = axes[1][0]
    progress = series["progress"]
    lat = [lat * 1000 for (_, lat, _) in progress]
    if lat:
        ax.hist(lat, bins=60, color="tab:green")
        for p, style in (("p50_ms", "--"), ("p99_ms", ":")):
            ax.axvline(w1["progress_latency"][p], color="black", linestyle=style, label=p)
        ax.legend()
    ax.set_title("progress latency: report_progress -> subscriber (ms)")
    ax.set_yscale("log")

    ax = axes[1][1]
    if progress:
        ax.scatter([t - t0 for (t, _, _) in progress], lat, s=2, alpha=0.4)
    ax.set_title("progress latency over time (ms)")
    ax.set_xlabel("s since first request")

    ax = axes[1][2]
    w2 = report.get("w2") or {}
    rt = [s * 1000 for s in (w2.get("_series") or {}).get("seconds", [])]
    if rt:
        ax.plot(range(1, len(rt) + 1), rt, ".", markersize=3)
        ax.axhline(w2["round_trip"]["p50_ms"], color="black", linestyle="--", label="p50")
        ax.legend()
    ax.set_title("W2 awaited round trip per run (ms)")
    ax.set_xlabel("run")

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
