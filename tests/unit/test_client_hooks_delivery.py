"""The hook delivery loop keeps to its concurrency when a fetch returns more than asked
(nats-py's fetch also hands over every message a timed-out fetch left in its queue)."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from eventually import eventually

from tether.client.errors import NotPermitted
from tether.client.hook_calls import DeliveryReports
from tether.client.hooks import HookRegistry
from tether.domain.commands import DeliveredCommand, DeliveryReport
from tether.domain.events import ParentRef

METHOD = "on_done"


class OverfullSubscription:
    """The first fetch returns `first` messages whatever the batch; later ones one each
    (each fetch's request sent, and its first message read, now: `adapters.pull.Pull`)."""

    def __init__(self, first: int, total: int) -> None:
        self.batches: list[int] = []
        self.remaining = total
        self.first = first
        self.sent_at = self.arrived_at = time.monotonic()

    async def fetch(self, batch: int, timeout: float):
        if batch < 1:  # what nats-py raises: "nats: invalid batch size"
            raise ValueError("nats: invalid batch size")
        self.batches.append(batch)
        self.sent_at = self.arrived_at = time.monotonic()
        count = min(self.first if len(self.batches) == 1 else 1, self.remaining)
        self.remaining -= count
        await asyncio.sleep(0)
        return [object() for _ in range(count)]


async def test_a_fetch_returning_more_than_asked_waits_for_room_instead_of_failing() -> None:
    concurrency, total = 4, 9
    registry = HookRegistry(SimpleNamespace(), "Importer", lease_ms=1_000,
                            concurrency=concurrency)
    subscription = OverfullSubscription(first=concurrency + 3, total=total)
    release, stop = asyncio.Event(), asyncio.Event()
    running, handled, peak = 0, 0, 0
    failures: list[str] = []
    registry._logger = SimpleNamespace(warning=lambda event, **kw: failures.append(kw["error"]))

    async def handle(method: str, msg, hold) -> None:
        nonlocal running, handled, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        handled += 1
        if handled == total:
            stop.set()

    registry.handle = handle
    delivering = asyncio.create_task(registry._deliver(METHOD, subscription, stop))
    # The overfull first fetch is being handled.
    await eventually(lambda: running >= concurrency + 3, interval=0)
    release.set()
    await asyncio.wait_for(delivering, 5)

    assert failures == []
    assert handled == total
    assert all(batch >= 1 for batch in subscription.batches)
    assert peak == concurrency + 3  # nothing more was fetched while over the limit


class Commands:
    """The one call the reports make of the connection: a publish that blocks until
    released, or raises `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.published: list[tuple[DeliveredCommand, str]] = []
        self.error = error
        self.release = asyncio.Event()

    async def publish_command(self, kind: str, command: DeliveredCommand, msg_id: str) -> None:
        assert kind == "delivered"
        self.published.append((command, msg_id))
        await self.release.wait()
        if self.error is not None:
            raise self.error


def _report(run_id: str) -> DeliveryReport:
    return DeliveryReport(run_id=run_id, parent=ParentRef(agent="Importer", name="acme"),
                          status="completed", method=METHOD,
                          message_id=f"finish:{run_id}:completed:life")


async def test_reports_waiting_together_raise_what_their_command_raised() -> None:
    commands = Commands(error=NotPermitted("may not send delivered commands"))
    reports = DeliveryReports(commands, logger=None)
    sends = [asyncio.create_task(reports.send(_report(f"r{n}"))) for n in range(3)]
    await eventually(lambda: len(commands.published) == 1)
    commands.release.set()
    for send in sends:
        with pytest.raises(NotPermitted, match="may not send"):
            await send
    [(command, msg_id)] = commands.published
    assert [r.run_id for r in command.reports()] == ["r0", "r1", "r2"]
    assert msg_id.startswith("delivered:Importer.acme:batch:")


async def test_reports_waiting_when_their_sender_is_cancelled_are_cancelled_too() -> None:
    commands = Commands()
    reports = DeliveryReports(commands, logger=None)
    sends = [asyncio.create_task(reports.send(_report(f"r{n}"))) for n in range(2)]
    await eventually(lambda: len(commands.published) == 1)
    later = asyncio.create_task(reports.send(_report("r-later")))  # waits for the next batch
    await eventually(lambda: len(reports._waiting) == 1)
    reports._sender.cancel()
    for send in (*sends, later):
        with pytest.raises(asyncio.CancelledError):
            await send
    assert not reports._waiting and len(commands.published) == 1
