"""The failing-test report's list of JetStream API calls the server failed (tests/support)."""

import asyncio
import time

import pytest
from jetstream_errors import ServerErrorWatch
from nats.js import api as js_api
from nats.js.errors import ServerError


async def test_a_request_the_server_fails_is_kept_with_its_subject_and_error(nc, nats_url,
                                                                             unique_name):
    watch = ServerErrorWatch(nats_url).start(timeout_s=30)
    try:
        assert watch.subscribed
        started = time.monotonic()
        # A single server cannot keep three replicas: a 500 of the stream-create API.
        with pytest.raises(ServerError):
            await nc.jetstream().add_stream(js_api.StreamConfig(
                name=unique_name, subjects=[f"{unique_name}.>"], num_replicas=3))
        (failure,) = await asyncio.to_thread(watch.wait_since, started, 30)
    finally:
        watch.stop()
    assert failure.subject == f"$JS.API.STREAM.CREATE.{unique_name}"
    assert failure.error["code"] == 500 and unique_name in failure.request
