"""A hook whose function is being called stays with the handler calling it, however long
the call: the reconciler's retries (after its delivery lease) publish no copy for another
replica to call meanwhile, and a plain function that blocks does not stop its renewals.
The function runs once, and is recorded once; one that keeps raising is retried by its
consumer alone."""

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from eventually import eventually
from hook_handlers import (
    PARENT,
    HookHandlerProcess,
    finish_detached_run,
    publish_finish_hook,
)
from service_processes import support_path

LEASE_MS = 1500


def handler_env(service_env: dict[str, str], lease_ms: int = LEASE_MS) -> dict[str, str]:
    return {**service_env, "TETHER_HOOK_LEASE_MS": str(lease_ms), "PYTHONPATH": support_path()}


def retried(reconciler, times: int) -> bool:
    """Whether the reconciler found the hook unacknowledged `times` times."""
    return any(line.get("event") == "agent_tool:detached:delivery_failed"
               and line.get("attempts", 0) >= times for line in reconciler.lines)


async def finish_delivered(log, run_id: str) -> int:
    history = await log.read_run(PARENT, run_id)
    return [event.type for event in history.events].count("run.finish_delivered")


@asynccontextmanager
async def two_handlers_with_a_finished_hook(log, env: dict[str, str]) -> AsyncIterator[list]:
    """Two hook handler processes of `env`, and a finished run's hook published to them;
    both stopped (and their lines printed) when the test is done with them."""
    handlers = [await HookHandlerProcess(env).start(), await HookHandlerProcess(env).start()]
    try:
        await finish_detached_run(log, "import-1")
        await publish_finish_hook(log, "import-1")
        yield handlers
    finally:
        for handler in handlers:
            await handler.stop()
            handler.print_lines()


# The hook lease: renewed (and its mark with it) before the reconciler's first look, or
# (9 s) only after it, when the call's first mark is what keeps the copy back.
@pytest.mark.parametrize("hook_lease_ms", [LEASE_MS, 9000])
async def test_a_hook_slower_than_the_delivery_lease_is_not_republished_to_another_replica(
        log, services, service_env, hook_lease_ms):
    await services("parent")
    # Looked at every 2 s while not acknowledged: four looks within the call below, past
    # two of its leases (the handler renews its mark of the call meanwhile).
    reconciler = await services("reconciler", TETHER_DELIVERY_LEASE_MS="2000",
                                TETHER_DELIVERY_MAX_BACKOFF_MS="2000")
    env = handler_env(service_env, hook_lease_ms)
    async with two_handlers_with_a_finished_hook(log, env) as handlers:
        await eventually(lambda: retried(reconciler, 4), timeout=30)
        # One call, still under way.
        assert sorted(handler.called() for handler in handlers) == [[], ["import-1"]]
        [calling] = [handler for handler in handlers if handler.called()]
        calling.signal(signal.SIGUSR1)  # the function returns
        await calling.logged("hooks.delivered", timeout=30)
        await eventually(lambda: finish_delivered(log, "import-1"), timeout=30)
    assert sorted(handler.called() for handler in handlers) == [[], ["import-1"]]
    assert await finish_delivered(log, "import-1") == 1


async def test_a_hook_that_keeps_raising_is_retried_by_its_consumer_not_copied(
        log, services, service_env):
    await services("parent")
    reconciler = await services("reconciler", TETHER_DELIVERY_LEASE_MS="1000",
                                TETHER_DELIVERY_MAX_BACKOFF_MS="1000")
    env = {**handler_env(service_env), "HOOK_RAISES": "1"}
    async with two_handlers_with_a_finished_hook(log, env) as handlers:
        await eventually(lambda: retried(reconciler, 5), timeout=30)
        hooks = await log.jetstream.stream_info(log.subjects.hooks_stream)
    # The one message, called again after each lease: no copy called beside it.
    assert hooks.state.messages == 1
    assert sum(len(handler.called()) for handler in handlers) >= 2


async def test_a_plain_function_that_blocks_past_the_lease_is_not_called_by_another_replica(
        log, services, service_env):
    await services("parent")
    # A synchronous hook (`time.sleep`, a blocking client) that takes over two leases.
    env = {**handler_env(service_env), "HOOK_BLOCKS_S": str(3 * LEASE_MS / 1000)}
    async with two_handlers_with_a_finished_hook(log, env) as handlers:
        await eventually(lambda: finish_delivered(log, "import-1"), timeout=30)
    assert sorted(handler.called() for handler in handlers) == [[], ["import-1"]]
    assert await finish_delivered(log, "import-1") == 1
