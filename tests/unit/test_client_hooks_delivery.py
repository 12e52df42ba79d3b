"""The hook delivery loop keeps to its concurrency when a fetch returns more than asked
(nats-py's fetch also hands over every message a timed-out fetch left in its queue)."""

import asyncio
from types import SimpleNamespace

from eventually import eventually

from tether.client.hooks import HookRegistry

METHOD = "on_done"


class OverfullSubscription:
    """The first fetch returns `first` messages whatever the batch; later ones one each."""

    def __init__(self, first: int, total: int) -> None:
        self.batches: list[int] = []
        self.remaining = total
        self.first = first

    async def fetch(self, batch: int, timeout: float):
        if batch < 1:  # what nats-py raises: "nats: invalid batch size"
            raise ValueError("nats: invalid batch size")
        self.batches.append(batch)
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

    async def handle(method: str, msg) -> None:
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
