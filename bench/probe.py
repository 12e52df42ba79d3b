"""A timeline subscriber in its own process: progress latency as a parent app sees it.

Subscribes (core NATS) to `<prefix>.progress.>`, the subjects the child-runner publishes
every progress signal and milestone on, and for each message records the receive time
and the latency from the child's `report_progress` call (`data.t` set by
bench.agents.BenchChild; `at`, in ms, otherwise). Being its own process keeps the
bench driver's busy event loop out of the measurement, and its collector is tuned as the
services' are, with the samples in arrays it never scans: with Python's defaults its own
full collections (60 ms, once the samples had piled up) showed up as a burst of a few
hundred late signals, and were most of the p99.

    python -m bench.probe --nats-url URL --prefix P --out FILE   (stop with SIGTERM)
"""

import argparse
import asyncio
import json
import signal
import sys
import time
from array import array
from collections import Counter

from tether.adapters.nats_connection import connect_nats
from tether.adapters.requests import subscribe_routed
from tether.cli import event_loop_factory
from tether.config import Settings
from tether.runtime import tune_gc


def category(subject: str, prefix: str) -> str:
    """`<prefix>.evt`, `$JS.API.DIRECT.GET`, `$JS.ACK`, `$KV`, `_INBOX`, ..."""
    tokens = subject.split(".")
    if tokens[0] == prefix:
        return "tether." + tokens[1]
    if tokens[0] == "$JS" and tokens[1] == "API":
        return ".".join(tokens[:4] if tokens[2] in ("DIRECT", "CONSUMER", "STREAM") else tokens[:3])
    if tokens[0] in ("$JS", "$KV"):
        return ".".join(tokens[:2])
    return tokens[0]


async def main(nats_url: str, prefix: str, out: str, count_subjects: bool) -> None:
    # Tether's client: a routed subscription calls `on_message` straight from the read
    # loop, without a queue, a task and a coroutine per message.
    nc = await connect_nats(nats_url, name="tether-bench-probe", fast_path=True)
    # Receive time, latency (s), milestone or not: numbers the collector does not track.
    received_at, latencies, milestones = array("d"), array("d"), array("b")
    clock = time.time

    def on_message(msg) -> None:
        now = clock()
        try:
            signal_ = json.loads(msg.data)
            data = signal_.get("data")
            sent = data["t"] if isinstance(data, dict) and "t" in data else signal_["at"] / 1000
        except (ValueError, KeyError, TypeError):
            return
        received_at.append(now)
        latencies.append(now - sent)
        milestones.append(1 if signal_.get("milestone") else 0)

    await subscribe_routed(nc, f"{prefix}.progress.>", on_message)
    subjects: Counter[str] = Counter()
    if count_subjects:
        async def count(msg) -> None:
            subjects[category(msg.subject, prefix)] += 1

        # Everything the clients publish, requests and replies included (doubles the
        # server's fan-out: for diagnosis, not for figures).
        await nc.subscribe(">", cb=count)
    await nc.flush()
    tune_gc(Settings.model_fields["gc_threshold"].default)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await nc.drain()
    write(out, {"progress": list(zip(received_at, latencies, milestones, strict=False)), "subjects": subjects})


def write(path: str, result: dict) -> None:
    with open(path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count-subjects", action="store_true")
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
        runner.run(main(args.nats_url, args.prefix, args.out, args.count_subjects))
    sys.exit(0)
