"""The metrics module over prometheus_client, and its Prometheus exposition."""

import asyncio
import math

import pytest

from tether.metrics import (
    EVENTS_PROJECTED,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    Registry,
    count_projected,
)
from tether.ports import StoredEvent
from tether.runtime import HealthServer
from tether.testing import RunEvents


@pytest.fixture
def registry() -> Registry:
    return Registry()


def without_created(text: str) -> str:
    """The exposition without the `_created` timestamps prometheus_client adds."""
    return "".join(line + "\n" for line in text.splitlines() if "_created" not in line)


def test_counters_and_gauges_render_with_escaped_labels(registry):
    runs = Gauge("t_runs", "Runs by status", ["status", "agent_type"], registry=registry)
    appended = Counter("t_appended_total", "Events appended", registry=registry)
    runs.replace({("running", "Researcher"): 2, ("completed", 'Quo"ted\\'): 5})
    appended.inc()
    appended.inc(2)
    assert without_created(registry.render()) == (
        "# HELP t_runs Runs by status\n"
        "# TYPE t_runs gauge\n"
        't_runs{agent_type="Researcher",status="running"} 2.0\n'
        't_runs{agent_type="Quo\\"ted\\\\",status="completed"} 5.0\n'
        "# HELP t_appended_total Events appended\n"
        "# TYPE t_appended_total counter\n"
        "t_appended_total 3.0\n")
    assert appended.value() == 3 and runs.value(status="running", agent_type="Researcher") == 2


def test_replacing_a_gauge_drops_the_series_left_out(registry):
    runs = Gauge("t_runs", "Runs by status", ["status"], registry=registry)
    runs.replace({("running",): 2, ("completed",): 5})
    runs.replace({("completed",): 6})
    assert runs.samples() == ['t_runs{status="completed"} 6.0']
    runs.inc(status="running")
    assert runs.value(status="running") == 1


def test_a_total_kept_elsewhere_grows_the_counter_and_a_smaller_one_starts_it_again(registry):
    appended = Counter("t_appended_total", "Events appended", registry=registry)
    appended.set_total(5)
    appended.set_total(12)
    assert appended.value() == 12
    appended.set_total(3)  # the stream was recreated
    assert appended.value() == 3


def test_histograms_are_cumulative_with_sum_and_count(registry):
    latency = Histogram("t_seconds", "Latency", ["handler"], buckets=(0.1, 1.0),
                        registry=registry)
    for value in (0.05, 0.5, 0.7, 3.0):
        latency.observe(value, handler="run")
    lines = [line for line in latency.samples() if "_created" not in line]
    assert lines[:3] == ['t_seconds_bucket{handler="run",le="0.1"} 1.0',
                         't_seconds_bucket{handler="run",le="1.0"} 3.0',
                         't_seconds_bucket{handler="run",le="+Inf"} 4.0']
    assert lines[3] == 't_seconds_count{handler="run"} 4.0'
    assert lines[4].startswith('t_seconds_sum{handler="run"} ')
    assert math.isclose(float(lines[4].split()[-1]), 4.25)
    assert latency.count(handler="run") == 4


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
    assert "t_lag 7.0\n" in text and calls == ["good"]
    remove()
    await registry.exposition()
    assert calls == ["good"]


def test_the_services_registry_has_the_process_and_gc_collectors():
    text = REGISTRY.render()
    for family in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                   "python_gc_collections_total", "python_info", "tether_handler_seconds",
                   "tether_events_appended_total", "tether_runner_slots_in_use"):
        assert f"# TYPE {family.removesuffix('_total')}" in text or f"# TYPE {family}" in text


async def scrape(port: int, accept: str | None = None) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                 + (f"Accept: {accept}\r\n".encode() if accept else b"") + b"\r\n")
    await writer.drain()
    response = (await reader.read()).decode()
    writer.close()
    head, _, body = response.partition("\r\n\r\n")
    content_type = next(line.split(":", 1)[1].strip() for line in head.splitlines()
                        if line.lower().startswith("content-type:"))
    return content_type, body


async def test_metrics_are_served_as_openmetrics_when_the_scrape_asks(registry):
    Counter("t_requests_total", "Requests", ["kind"], registry=registry).inc(kind="a")
    server = HealthServer("127.0.0.1", 0, {}, metrics=registry)
    await server.start()
    try:
        content_type, body = await scrape(server.port)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert 't_requests_total{kind="a"} 1.0\n' in body and "# EOF" not in body
        content_type, body = await scrape(
            server.port, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
        assert content_type.startswith("application/openmetrics-text; version=1.0.0")
        assert "# TYPE t_requests counter\n" in body
        assert 't_requests_total{kind="a"} 1.0\n' in body and body.endswith("# EOF\n")
    finally:
        await server.stop()


def test_a_projected_batch_is_counted_by_event_type_undecodable_ones_too():
    run = RunEvents("r-counted")
    events = [run.requested(), run.running(), run.milestone("a"), run.milestone("b")]
    batch = [StoredEvent(seq, "t.evt.a.b.r", event, None, b"", 0)
             for seq, event in enumerate(events, 1)]
    batch.append(StoredEvent(5, "t.evt.a.b.r", None, None, b"not json", 0))
    before = {kind: EVENTS_PROJECTED.value(type=kind)
              for kind in ("run.requested", "run.running", "run.milestone", "undecodable")}
    count_projected(batch)
    assert {kind: EVENTS_PROJECTED.value(type=kind) - n for kind, n in before.items()} == {
        "run.requested": 1, "run.running": 1, "run.milestone": 2, "undecodable": 1}
