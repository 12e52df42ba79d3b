"""The dependency-free metrics module and its Prometheus text exposition."""

import math

import pytest

from tether.metrics import Counter, Gauge, Histogram, Registry


@pytest.fixture
def registry() -> Registry:
    return Registry()


def test_counters_and_gauges_render_with_labels_in_a_stable_order(registry):
    runs = Gauge("t_runs", "Runs by status", ["status", "agent_type"], registry=registry)
    appended = Counter("t_appended_total", "Events appended", registry=registry)
    runs.replace({("running", "Researcher"): 2, ("completed", 'Quo"ted\\'): 5})
    appended.inc()
    appended.inc(2)
    assert registry.render() == (
        "# HELP t_appended_total Events appended\n"
        "# TYPE t_appended_total counter\n"
        "t_appended_total 3\n"
        "# HELP t_runs Runs by status\n"
        "# TYPE t_runs gauge\n"
        't_runs{status="completed",agent_type="Quo\\"ted\\\\"} 5\n'
        't_runs{status="running",agent_type="Researcher"} 2\n')


def test_histograms_are_cumulative_with_sum_and_count(registry):
    latency = Histogram("t_seconds", "Latency", ["handler"], buckets=(0.1, 1.0),
                        registry=registry)
    for value in (0.05, 0.5, 0.7, 3.0):
        latency.observe(value, handler="run")
    lines = latency.samples()
    assert lines[:3] == ['t_seconds_bucket{handler="run",le="0.1"} 1',
                         't_seconds_bucket{handler="run",le="1"} 3',
                         't_seconds_bucket{handler="run",le="+Inf"} 4']
    assert math.isclose(float(lines[3].split()[-1]), 4.25)
    assert lines[4] == 't_seconds_count{handler="run"} 4'


def test_wrong_labels_and_a_falling_counter_are_refused(registry):
    counter = Counter("t_total", "x", ["kind"], registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        counter.inc(kind="a", extra="b")
    with pytest.raises(ValueError, match="cannot go down"):
        counter.inc(-1, kind="a")
    with pytest.raises(ValueError, match="already registered"):
        Counter("t_total", "again", registry=registry)


async def test_a_failing_collector_keeps_the_last_values_and_the_scrape_succeeds(registry):
    lag = Gauge("t_lag", "Lag", registry=registry)
    calls = []

    async def good() -> None:
        calls.append("good")
        lag.set(7)

    async def broken() -> None:
        raise ConnectionError("nats is away")

    remove = registry.add_collector(good)
    registry.add_collector(broken)
    text = await registry.exposition()
    assert "t_lag 7\n" in text and calls == ["good"]
    remove()
    await registry.exposition()
    assert calls == ["good"]
