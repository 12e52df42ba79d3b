"""`Pull`: a durable pull consumer's messages as soon as one is there, none lost."""

import asyncio
import contextlib

import pytest
from eventually import eventually
from nats.js import api as js_api
from nats.js.errors import APIError

from tether.adapters.nats_connection import connect_nats
from tether.adapters.pull import Pull, durable_pull

WAIT_S = 30  # a fetch's timeout, far longer than any answer below may take


@pytest.fixture
async def stream(nc, unique_name):
    js = nc.jetstream()
    name = f"{unique_name}-pull"
    await js.add_stream(name=name, subjects=[f"{unique_name}.pull.>"])
    yield name, f"{unique_name}.pull.x"
    await js.delete_stream(name)


async def pull_of(nc, stream_name: str, durable: str = "worker") -> Pull:
    config = js_api.ConsumerConfig(durable_name=durable, ack_policy=js_api.AckPolicy.EXPLICIT,
                                   ack_wait=30)
    return await durable_pull(nc.jetstream(), nc, stream_name, config)


async def test_a_lone_message_is_handed_over_without_waiting_for_a_full_batch(nc, stream):
    name, subject = stream
    pull = await pull_of(nc, name)
    waiting = asyncio.create_task(pull.fetch(64, timeout=WAIT_S))

    async def request_waiting() -> bool:  # the fetch's lingering request, at the server
        return (await nc.jetstream().consumer_info(name, "worker")).num_waiting == 1

    await eventually(request_waiting)
    await nc.jetstream().publish(subject, b"one")
    # Not held back for the 63 others a fetch of 64 could take.
    async with asyncio.timeout(WAIT_S / 3):
        messages = await waiting
    assert [m.data for m in messages] == [b"one"]
    await messages[0].ack()
    await pull.unsubscribe()


async def test_a_fetch_takes_what_is_there_up_to_its_batch_and_loses_nothing(nc, stream):
    name, subject = stream
    js = nc.jetstream()
    for n in range(5):
        await js.publish(subject, f"m{n}".encode())
    pull = await pull_of(nc, name)
    first = await pull.fetch(3, timeout=WAIT_S)
    second = await pull.fetch(3, timeout=WAIT_S)
    assert [m.data for m in first] == [b"m0", b"m1", b"m2"]
    assert [m.data for m in second] == [b"m3", b"m4"]
    for msg in first + second:
        await msg.ack()
    assert first[0].metadata.sequence.stream == 1  # a JetStream delivery, ackable

    with pytest.raises(TimeoutError, match=r"no message from consumer worker within 0.3s"):
        await pull.fetch(8, timeout=0.3)
    # What comes after a fetch gave up is the next fetch's: its request had expired.
    await js.publish(subject, b"late")
    assert [m.data for m in await pull.fetch(8, timeout=WAIT_S)] == [b"late"]
    with pytest.raises(ValueError, match="at least 1 message"):
        await pull.fetch(0, timeout=1)
    await pull.unsubscribe()


async def test_a_status_an_earlier_request_left_neither_holds_up_nor_swallows_a_message(
        nc, stream):
    name, subject = stream
    pull = await pull_of(nc, name)

    class LateStatusFirst:
        """Before the fetch's first request, a timed-out request's expiry (408) arrives:
        its answer then seems to be "nothing", and the message it brings comes after."""

        def __init__(self) -> None:
            self.injected = False

        async def publish(self, subject: str, payload: bytes, **options) -> None:
            if not self.injected:
                self.injected = True
                await nc.publish(pull._inbox, b"", headers={"Status": "408"})
            await nc.publish(subject, payload, **options)

    await nc.jetstream().publish(subject, b"next")
    pull._nc = LateStatusFirst()
    # nats-py's fetch then waits for the rest of the batch until its timeout.
    async with asyncio.timeout(WAIT_S / 3):
        messages = await pull.fetch(8, timeout=WAIT_S)
    assert [m.data for m in messages] == [b"next"]
    await messages[0].ack()
    pull._nc = nc
    await pull.unsubscribe()


async def test_a_request_left_open_by_a_stopped_puller_swallows_nothing(nc, stream):
    name, subject = stream
    stopped = await pull_of(nc, name)
    # What a derailed fetch may leave behind: a lingering request still open.
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{name}.worker",
                     b'{"batch": 1, "expires": 30000000000}', reply=stopped._inbox)
    await nc.flush()
    await stopped.unsubscribe()
    await nc.flush()
    await nc.jetstream().publish(subject, b"after")
    other = await pull_of(nc, name)
    messages = await other.fetch(1, timeout=WAIT_S / 3)
    assert [m.data for m in messages] == [b"after"]
    await messages[0].ack()
    await other.unsubscribe()


async def test_replicas_share_the_consumer_and_each_message_goes_to_one(nc, stream):
    name, subject = stream
    first, second = await pull_of(nc, name), await pull_of(nc, name)
    for n in range(20):
        await nc.jetstream().publish(subject, f"m{n}".encode())
    taken: dict[Pull, list[bytes]] = {first: [], second: []}
    pulls = [first, second] * 10
    while sum(map(len, taken.values())) < 20:
        pull = pulls.pop()
        for msg in await pull.fetch(4, timeout=WAIT_S):
            taken[pull].append(msg.data)
            await msg.ack()
    assert sorted(taken[first] + taken[second]) == sorted(f"m{n}".encode() for n in range(20))
    assert taken[first] and taken[second]
    for pull in (first, second):
        await pull.unsubscribe()


async def test_a_deleted_consumer_is_an_error_not_a_silent_wait(nc, stream):
    name, _ = stream
    pull = await pull_of(nc, name, durable="gone")
    await nc.jetstream().delete_consumer(name, "gone")
    with pytest.raises(APIError):
        await pull.fetch(4, timeout=2)
    await pull.unsubscribe()


async def test_a_pull_loop_goes_on_through_a_server_crash_and_restart(devstack, tmp_path):
    # A server of its own, killed as in a crash and started again on its port and store.
    port = devstack.free_port()

    def start():
        return devstack.start_nats(tmp_path / "store", port, tmp_path / "nats.log", daemon=False)

    server = start()
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await connect_nats(f"nats://127.0.0.1:{port}", name="pull-restart",
                            reconnected_cb=on_reconnect)
    try:
        js = nc.jetstream()
        await js.add_stream(name="RESTART", subjects=["restart.>"])
        pull = await pull_of(nc, "RESTART")
        await js.publish("restart.x", b"before")
        before = await pull.fetch(4, timeout=WAIT_S)
        assert [m.data for m in before] == [b"before"]
        await before[0].ack()

        server.kill()
        server.wait(timeout=10)
        # While it is gone a fetch ends as a timeout, and the loop may go on.
        with pytest.raises(TimeoutError):
            await pull.fetch(4, timeout=0.3)
        server = start()
        async with asyncio.timeout(WAIT_S):
            await reconnected.wait()
        await js.publish("restart.x", b"after")
        # At least once: an ack the crash lost brings "before" again.
        seen: list[bytes] = []
        async with asyncio.timeout(WAIT_S):
            while b"after" not in seen:
                with contextlib.suppress(TimeoutError):
                    for msg in await pull.fetch(4, timeout=1):
                        seen.append(msg.data)
                        await msg.ack()
        assert set(seen) <= {b"before", b"after"} and seen.count(b"after") == 1
        await pull.unsubscribe()
    finally:
        await nc.close()
        server.kill()
        server.wait(timeout=10)
