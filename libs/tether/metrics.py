"""Prometheus metrics through `prometheus_client`: counters, gauges and histograms with
labels, served on each service's `/metrics` in the text format (0.0.4), or OpenMetrics
when the scrape's Accept header asks for it, with the process and garbage-collector
metrics (`process_*`, `python_gc_*`, `python_info`).

Instruments are module-level and take their labels as keyword arguments
(`WORK_ITEMS.inc(agent_type=..., outcome=...)`); each keeps the labelled child of every
label set it has seen, so a hot path pays a dict lookup and the child's update. Values
that live elsewhere (a stream's last sequence, a table's row counts, a consumer's pending
messages) are read at scrape time by collectors a service registers while it runs, never
polled in the background.
"""

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from tether.log import get_logger

Labels = tuple[str, ...]
Collector = Callable[[], Awaitable[None]]

# Seconds. Wide on purpose: the same histogram times a 2 ms command and a 20 min child.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0, 1800.0)
COLLECT_TIMEOUT_S = 2.0


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: "Registry | None" = None, **options: Any) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames: Labels = tuple(labelnames)
        self._registry = registry if registry is not None else REGISTRY
        self._registry.register(self)
        self._metric = self._create(name, documentation, self.labelnames,
                                    registry=self._registry.prometheus, **options)
        self._children: dict[tuple[tuple[str, str], ...], Any] = {}

    def _create(self, *args: Any, **options: Any) -> Any:
        raise NotImplementedError

    def _key(self, labels: dict[str, str]) -> Labels:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        try:
            return tuple(str(labels[name]) for name in self.labelnames)
        except KeyError as missing:
            raise ValueError(f"{self.name} takes labels {self.labelnames}, "
                             f"not {sorted(labels)}") from missing

    def _child(self, labels: dict[str, str]) -> Any:
        # Keyed by the labels as the caller passed them, which a call site always does in
        # the same order: a hot path hashes one tuple and skips the check of the names.
        call = tuple(labels.items())
        child = self._children.get(call)
        if child is None:
            child = self._children[call] = self._resolve(labels)
        return child

    def _resolve(self, labels: dict[str, str]) -> Any:
        if not self.labelnames:
            if labels:
                raise ValueError(f"{self.name} takes no labels, got {sorted(labels)}")
            return self._metric
        return self._metric.labels(*self._key(labels))

    def _sample(self, suffix: str, labels: dict[str, str]) -> float:
        key = self._key(labels)
        value = self._registry.prometheus.get_sample_value(
            self.name + suffix, dict(zip(self.labelnames, key, strict=True)))
        return value or 0.0

    def samples(self) -> list[str]:
        """This metric's sample lines in the text format."""
        text = generate_latest(self._registry.prometheus.restricted_registry(
            self._sample_names())).decode()
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    def _sample_names(self) -> list[str]:
        return [self.name]


class Counter(_Metric):
    """Only goes up (a restart starts it again at zero, which Prometheus' rate() expects)."""

    kind = "counter"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._totals: dict[Labels, float] = {}

    def _create(self, *args: Any, **options: Any) -> Any:
        return prometheus_client.Counter(*args, **options)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down")
        self._child(labels).inc(amount)

    def set_total(self, value: float, **labels: str) -> None:
        """For a count kept elsewhere that only grows (a stream's last sequence); a smaller
        one (the stream was recreated) starts the counter again."""
        key = self._key(labels)
        child = self._child(labels)
        previous = self._totals.get(key, 0.0)
        if value < previous:
            child.reset()
            previous = 0.0
        child.inc(value - previous)
        self._totals[key] = float(value)

    def value(self, **labels: str) -> float:
        return self._sample("", labels)

    def _sample_names(self) -> list[str]:
        return [self.name, self.name.removesuffix("_total") + "_created"]


class Gauge(_Metric):
    kind = "gauge"

    def _create(self, *args: Any, **options: Any) -> Any:
        return prometheus_client.Gauge(*args, **options)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).dec(amount)

    def replace(self, values: dict[Labels, float]) -> None:
        """Set every series at once; series not in `values` disappear (a status with no runs)."""
        for key in values:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
        self._metric.clear()
        self._children.clear()
        for key, value in values.items():
            self._child(dict(zip(self.labelnames, map(str, key), strict=True))).set(value)

    def value(self, **labels: str) -> float:
        return self._sample("", labels)


class _Timer:
    def __init__(self, histogram: "Histogram") -> None:
        self._histogram, self._started = histogram, time.monotonic()

    def observe(self, **labels: str) -> None:
        self._histogram.observe(time.monotonic() - self._started, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 buckets: Iterable[float] = DEFAULT_BUCKETS,
                 registry: "Registry | None" = None) -> None:
        self.buckets = tuple(sorted(buckets))
        super().__init__(name, documentation, labelnames, registry, buckets=self.buckets)

    def _create(self, *args: Any, **options: Any) -> Any:
        return prometheus_client.Histogram(*args, **options)

    def start(self) -> _Timer:
        """`clock = H.start()` ... `clock.observe(**labels)`: two lines around a handler."""
        return _Timer(self)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._sample("_count", labels))

    def _sample_names(self) -> list[str]:
        return [self.name + suffix for suffix in ("_bucket", "_sum", "_count", "_created")]


class Registry:
    """Tether's instruments in a `prometheus_client.CollectorRegistry` (`prometheus`), and
    the scrape-time collectors that refresh them."""

    def __init__(self, *, process_collectors: bool = False) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        if process_collectors:
            ProcessCollector(registry=self.prometheus)
            GCCollector(registry=self.prometheus)
            PlatformCollector(registry=self.prometheus)
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Collector] = []
        self._logger = get_logger(component="metrics")
        self._failing: set[str] = set()

    def register(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric

    def get(self, name: str) -> _Metric:
        return self._metrics[name]

    def add_collector(self, collector: Collector) -> Callable[[], None]:
        """Run `collector` before each scrape; returns the function that removes it."""
        self._collectors.append(collector)
        return lambda: self._collectors.remove(collector) if collector in self._collectors else None

    async def collect(self) -> None:
        """Refresh scrape-time values; a failing collector keeps its last values and is
        logged once per failure streak, so a scrape never fails because NATS or Postgres
        is briefly away."""
        for collector in list(self._collectors):
            name = getattr(collector, "__qualname__", repr(collector))
            try:
                async with asyncio.timeout(COLLECT_TIMEOUT_S):
                    await collector()
            except Exception as error:  # noqa: BLE001 - see the docstring
                COLLECTOR_FAILURES.inc(collector=name)
                if name not in self._failing:
                    self._failing.add(name)
                    self._logger.warning("metrics.collector_failed", collector=name,
                                         error=f"{type(error).__name__}: {error}")
            else:
                self._failing.discard(name)

    def render(self) -> str:
        """Every metric in the text format (0.0.4)."""
        return generate_latest(self.prometheus).decode()

    async def exposition(self) -> str:
        with suppress(asyncio.CancelledError):
            await self.collect()
        return self.render()

    async def scrape(self, accept: str | None) -> tuple[bytes, str]:
        """The body and content type of a scrape: OpenMetrics when `accept` (the
        request's Accept header) asks for it, the text format otherwise."""
        with suppress(asyncio.CancelledError):
            await self.collect()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.prometheus), content_type


REGISTRY = Registry(process_collectors=True)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

COLLECTOR_FAILURES = Counter(
    "tether_metrics_collector_failures_total",
    "Scrape-time collectors that failed (their metrics keep the last value)", ["collector"])

# --- Tether's instruments (docs/operations.md lists them) ------------------------------

RUNS = Gauge("tether_runs", "Runs in the projection by status and agent type",
             ["status", "agent_type"])
EVENTS_APPENDED = Counter("tether_events_appended_total",
                          "Events appended to the log (the events stream's last sequence)")
EVENTS_PROJECTED = Counter("tether_events_projected_total",
                           "Events this projector applied, by event type", ["type"])
PROJECTOR_POSITION = Gauge("tether_projector_position",
                           "Stream sequence the projection is checkpointed at")
PROJECTOR_LAG_EVENTS = Gauge("tether_projector_lag_events",
                             "Events appended to the log and not yet projected")
PROJECTOR_LAG_SECONDS = Gauge("tether_projector_lag_seconds",
                              "Age of the oldest event not yet projected (0 when caught up)")
PROJECTOR_ACTIVE = Gauge("tether_projector_active",
                         "1 when this projector holds the lock, 0 on a standby")
DEAD_LETTERED = Counter("tether_dead_lettered_total",
                        "Messages set aside as dead letters: event (projector), command "
                        "(parent), work_item (child-runner)", ["kind"])
DEADLINES_DUE = Counter("tether_deadlines_due_total",
                        "Reconciler deadlines that fell due, by kind", ["kind"])
DEADLINES_FIRED = Counter("tether_deadlines_fired_total",
                          "Due deadlines that led to a decision (a give-up, a delivery "
                          "retry), by kind", ["kind"])
BUDGETS = Gauge("tether_budgets",
                "The open runs with a token or cost budget (over them and the runs below "
                "them), summed: spent, reserved by open runs below them, and left; kind "
                "tokens or cost (on the active reconciler)", ["kind", "state"])
RECONCILER_ACTIVE = Gauge("tether_reconciler_active",
                          "1 when this reconciler holds the lease, 0 on a standby")
DECISIONS_FAILED = Counter("tether_reconciler_decisions_failed_total",
                           "Reconciler decisions that raised and were rescheduled; "
                           "kind=delivery are failed deliveries", ["kind"])
DELIVERIES_RETRIED = Counter("tether_deliveries_retried_total",
                             "Finish hooks and notifications published again after their lease")
DELIVERIES_PENDING = Gauge("tether_deliveries_pending",
                           "Hook messages not yet acknowledged by the application, by consumer",
                           ["consumer"])
DELIVERIES_REDELIVERED = Gauge("tether_deliveries_redelivered",
                               "Hook messages delivered more than once and still unacknowledged "
                               "(the handler failed or outlived its lease), by consumer",
                               ["consumer"])
WORK_PENDING = Gauge("tether_work_pending",
                     "Work items waiting for or held by a child-runner, by agent type",
                     ["agent_type"])
WORK_ITEMS = Counter("tether_work_items_total",
                     "Work items a child-runner finished with, by agent type and outcome",
                     ["agent_type", "outcome"])
LOOP_BLOCKED = Counter("tether_event_loop_blocked_total",
                       "Times a child-runner's event loop did not run for "
                       "TETHER_LOOP_BLOCKED_WARN_MS, by the agent type whose child held it "
                       "(empty: not a child)", ["agent_type"])
RUNNER_SLOTS = Gauge("tether_runner_slots", "Child-runner slots (runner_concurrency)")
RUNNER_SLOTS_IN_USE = Gauge("tether_runner_slots_in_use", "Child-runner slots running a child")
HANDLER_SECONDS = Histogram("tether_handler_seconds",
                            "Time to handle one message or decision, by service and handler",
                            ["service", "handler"])


def count_projected(batch) -> None:
    """Count a projected batch by event type (`StoredEvent`s; undecodable ones too): one
    increment per type, not per event."""
    types = collections.Counter(stored.event.type if stored.event is not None else "undecodable"
                                for stored in batch)
    for kind, events in types.items():
        EVENTS_PROJECTED.inc(events, type=kind)
