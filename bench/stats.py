"""Percentiles and latency summaries."""

import math


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(p / 100 * len(ordered))))
    return ordered[rank - 1]


def latency_summary(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"count": len(ms), "p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms, default=float("nan")),
            "mean_ms": sum(ms) / len(ms) if ms else float("nan")}
