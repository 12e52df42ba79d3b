"""The broker's clock (`tether.adapters.broker_clock`) against a real nats-server, read by
a process whose own wall clock is right and by one whose wall clock is 30 s ahead."""

import asyncio
import json
import sys
import textwrap
import time

from skewed_clock import skewed_env

from tether.adapters.broker_clock import BrokerClock


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    info = warning


async def test_a_process_with_a_true_clock_reads_the_brokers_time_and_no_skew(log):
    lines = Lines()
    clock = BrokerClock(log.nats, log.subjects.events_stream, lines)
    await clock.sample()

    assert abs(clock.now() - time.time() * 1000) < 500
    assert abs(clock.skew_ms) < 500
    assert lines.lines == []


SKEWED = textwrap.dedent("""
    import asyncio, json, sys, time
    import nats
    from tether.adapters.broker_clock import BrokerClock

    class Lines:
        def warning(self, event, **fields):
            print(json.dumps({"event": event, **fields}), flush=True)
        info = warning

    async def main():
        nc = await nats.connect(sys.argv[1])
        clock = BrokerClock(nc, sys.argv[2], Lines(), warn_skew_ms=2000)
        await clock.sample()
        await asyncio.sleep(0.3)  # carried on the monotonic clock, which is real
        print(json.dumps({"now": clock.now(), "wall": time.time() * 1000,
                          "skew_ms": clock.skew_ms}), flush=True)
        await nc.close()

    asyncio.run(main())
""")


async def test_a_process_whose_clock_is_30s_ahead_reads_the_brokers_time_and_warns(
        log, settings):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SKEWED, settings.nats_url, log.subjects.events_stream,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=skewed_env("+30s"))
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    *warnings, reading = [json.loads(line) for line in out.decode().splitlines()]
    real_now = time.time() * 1000

    assert reading["wall"] - real_now > 25_000, "the process's wall clock was not skewed"
    assert 29_000 < reading["skew_ms"] < 31_000, reading
    assert abs(reading["now"] - real_now) < 2_000, "the broker's time, whatever the wall says"
    [skewed] = warnings
    assert skewed["event"] == "clock.skewed" and skewed["skew_ms"] == reading["skew_ms"]
