"""Prometheus metrics without a dependency: counters, gauges and histograms with labels,
and the text exposition format (version 0.0.4) served on each service's `/metrics`.

Instruments are module-level, like `prometheus_client`'s, so a hot path pays one dict
update per call and no lookup of a registry. Values that live elsewhere (a stream's last
sequence, a table's row counts, a consumer's pending messages) are read at scrape time
by collectors a service registers while it runs, never polled in the background.
"""

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import suppress

from tether.log import get_logger

Labels = tuple[str, ...]
Collector = Callable[[], Awaitable[None]]

# Seconds. Wide on purpose: the same histogram times a 2 ms command and a 20 min child.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0, 1800.0)
COLLECT_TIMEOUT_S = 2.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2 ** 53 else repr(value)


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: "Registry | None" = None) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames: Labels = tuple(labelnames)
        (registry if registry is not None else REGISTRY).register(self)

    def _key(self, labels: dict[str, str]) -> Labels:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        try:
            return tuple(str(labels[name]) for name in self.labelnames)
        except KeyError as missing:
            raise ValueError(f"{self.name} takes labels {self.labelnames}, "
                             f"not {sorted(labels)}") from missing

    def _selector(self, key: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labelnames, key), *extra]
        if not pairs:
            return ""
        return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        head = (f"# HELP {self.name} {_escape(self.documentation)}\n"
                f"# TYPE {self.name} {self.kind}\n")
        return head + "".join(line + "\n" for line in self.samples())


class Counter(_Metric):
    """Only goes up (a restart starts it again at zero, which Prometheus' rate() expects)."""

    kind = "counter"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, value: float, **labels: str) -> None:
        """For a count kept elsewhere that only grows (a stream's last sequence)."""
        self._values[self._key(labels)] = float(value)

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{self._selector(key)} {_number(value)}"
                for key, value in sorted(self._values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def replace(self, values: dict[Labels, float]) -> None:
        """Set every series at once; series not in `values` disappear (a status with no runs)."""
        for key in values:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
        self._values = {tuple(map(str, k)): float(v) for k, v in values.items()}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{self._selector(key)} {_number(value)}"
                for key, value in sorted(self._values.items())]


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
        super().__init__(name, documentation, labelnames, registry)
        self.buckets = tuple(sorted(buckets))
        # Per series: a count per bucket (not cumulative; summed when rendered), sum, count.
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}

    def start(self) -> _Timer:
        """`clock = H.start()` ... `clock.observe(**labels)`: two lines around a handler."""
        return _Timer(self)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
        counts, totals = series
        index = len(self.buckets)
        for position, bound in enumerate(self.buckets):
            if value <= bound:
                index = position
                break
        counts[index] += 1
        totals[0] += value
        totals[1] += 1

    def count(self, **labels: str) -> int:
        series = self._series.get(self._key(labels))
        return int(series[1][1]) if series else 0

    def samples(self) -> list[str]:
        lines = []
        for key, (counts, (total, count)) in sorted(self._series.items()):
            running = 0
            for bound, bucket_count in zip((*self.buckets, math.inf), counts):
                running += bucket_count
                lines.append(f"{self.name}_bucket{self._selector(key, (('le', _number(bound)),))}"
                             f" {running}")
            lines.append(f"{self.name}_sum{self._selector(key)} {_number(total)}")
            lines.append(f"{self.name}_count{self._selector(key)} {_number(count)}")
        return lines


class Registry:
    def __init__(self) -> None:
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
                await asyncio.wait_for(collector(), timeout=COLLECT_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - see the docstring
                COLLECTOR_FAILURES.inc(collector=name)
                if name not in self._failing:
                    self._failing.add(name)
                    self._logger.warning("metrics.collector_failed", collector=name,
                                         error=f"{type(error).__name__}: {error}")
            else:
                self._failing.discard(name)

    def render(self) -> str:
        return "".join(metric.render() for _, metric in sorted(self._metrics.items()))

    async def exposition(self) -> str:
        with suppress(asyncio.CancelledError):
            await self.collect()
        return self.render()


REGISTRY = Registry()
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COLLECTOR_FAILURES = Counter(
    "tether_metrics_collector_failures_total",
    "Scrape-time collectors that failed (their metrics keep the last value)", ["collector"])

# --- Tether's instruments (DESIGN.md "observability"; the README lists them) ------------

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
RUNNER_SLOTS = Gauge("tether_runner_slots", "Child-runner slots (runner_concurrency)")
RUNNER_SLOTS_IN_USE = Gauge("tether_runner_slots_in_use", "Child-runner slots running a child")
HANDLER_SECONDS = Histogram("tether_handler_seconds",
                            "Time to handle one message or decision, by service and handler",
                            ["service", "handler"])


def count_projected(batch) -> None:
    """Count a projected batch by event type (`StoredEvent`s; undecodable ones too)."""
    for stored in batch:
        EVENTS_PROJECTED.inc(type=stored.event.type if stored.event is not None else "undecodable")
