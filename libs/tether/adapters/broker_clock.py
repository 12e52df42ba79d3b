"""The broker's clock: the one time every process of a deployment shares.

A process's wall clock can be off by any amount (a VM without time sync, a container
on a skewed host); JetStream stamps every stored message with the server's time. So
deadlines count from the stored time of the events they start at (`StoredEvent.
logged_at`), and are compared with `BrokerClock.now()`: the server's time as of the last
sample, carried forward on this process's monotonic clock, which a wrong or stepped
wall clock does not move. A sample asks the server for a stream's info, which carries its
time (`ts`), and takes the midpoint of the round trip.

Every service samples it and logs `clock.skewed` (and `clock.agrees` once it agrees
again) when its own wall clock is more than `TETHER_CLOCK_SKEW_WARN_MS` from the
broker's: `occurred_at` stamps and log lines of that process are then off by as much,
although no deadline is.
"""

import asyncio
import json
import time

from nats.aio.client import Client as NATS

from tether.adapters.event_log import log_time_ms
from tether.ports import SYSTEM_CLOCK
from tether.resilience import TRANSIENT_ERRORS, describe, sleep_unless_stopped

SAMPLE_EVERY_S = 10.0
SAMPLE_TIMEOUT_S = 5.0
SAMPLE_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, ValueError, KeyError)


class BrokerClock:
    def __init__(self, nc: NATS, stream: str, logger, *, warn_skew_ms: int = 2_000,
                 sample_every_s: float = SAMPLE_EVERY_S) -> None:
        self._nc, self._stream, self._logger = nc, stream, logger
        self._warn_skew_ms, self._sample_every_s = warn_skew_ms, sample_every_s
        # (the broker's time in ms, this process's monotonic time then) of the last sample
        self._anchor: tuple[int, float] | None = None
        self._sampled = asyncio.Event()
        self.skew_ms: int | None = None  # this process's wall clock minus the broker's
        self._warned = False

    def now(self) -> int:
        """The broker's time now, in epoch ms (before the first sample, this process's)."""
        if self._anchor is None:
            return SYSTEM_CLOCK.now()
        at, mono = self._anchor
        return at + int((time.monotonic() - mono) * 1000)

    async def sampled(self) -> None:
        """Until the first sample has been taken."""
        await self._sampled.wait()

    async def sample(self) -> None:
        sent, wall_sent = time.monotonic(), SYSTEM_CLOCK.now()
        reply = await self._nc.request(f"$JS.API.STREAM.INFO.{self._stream}", b"",
                                       timeout=SAMPLE_TIMEOUT_S)
        received, wall_received = time.monotonic(), SYSTEM_CLOCK.now()
        stamp = log_time_ms(json.loads(reply.data).get("ts"))
        if stamp is None:
            raise ValueError(f"the server's stream info for {self._stream} carries no time "
                             f"(ts): nats-server 2.11 or newer is needed")
        self._anchor = (stamp, (sent + received) / 2)
        self._sampled.set()
        self.skew_ms = (wall_sent + wall_received) // 2 - stamp
        self._report_skew(received - sent)

    def _report_skew(self, round_trip_s: float) -> None:
        assert self.skew_ms is not None
        # A slow round trip blurs the reading by up to half of it.
        off = abs(self.skew_ms) > self._warn_skew_ms + round_trip_s * 500
        if off and not self._warned:
            self._warned = True
            self._logger.warning("clock.skewed", skew_ms=self.skew_ms,
                                 warn_at_ms=self._warn_skew_ms,
                                 detail="this process's wall clock is off from the broker's; "
                                        "deadlines are measured on the broker's clock, but "
                                        "this process's occurred_at stamps and log times are "
                                        "off by as much")
        elif not off and self._warned and abs(self.skew_ms) < self._warn_skew_ms / 2:
            self._warned = False
            self._logger.info("clock.agrees", skew_ms=self.skew_ms)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every `sample_every_s` until `stop`; a failed sample keeps the last one
        (carried on the monotonic clock, it stays right) and is tried again."""
        failing = False
        while not stop.is_set():
            try:
                await self.sample()
                failing = False
            except SAMPLE_ERRORS as error:
                if not failing:
                    failing = True
                    self._logger.warning("clock.sample_failed", error=describe(error))
            delay = self._sample_every_s if self._anchor is not None else 0.5
            if await sleep_unless_stopped(stop, delay):
                return
