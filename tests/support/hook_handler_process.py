"""A hook handler as a process of its own, for the tests that pause one: it serves
`on_import_done` of the parent agent `Importer`; each call logs `test.hook_called` (with
the run id) and then waits for SIGUSR1; with HOOK_BLOCKS_S set, it is a plain function
that blocks (`time.sleep`) for that many seconds instead, and with HOOK_RAISES set, it
raises (a downstream that is down). Its connection and lease come from the
TETHER_* environment; it logs JSON lines on stderr, and stops on SIGTERM. Its fetches
wait up to 30 s for a hook (the handler's own wait is half a second), so that a hook
published while it is stopped is delivered to it all the same."""

import asyncio
import os
import signal
import time

from tether.client import connect
from tether.client import hooks as hooks_module
from tether.client.hook_calls import HookFunction
from tether.log import configure_logging, get_logger

PARENT_AGENT, METHOD = "Importer", "on_import_done"


async def main() -> None:
    configure_logging(fmt="json")
    hooks_module.FETCH_WAIT_S = 30.0
    stop, released = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, released.set)

    async def import_done(run, result) -> None:
        get_logger().info("test.hook_called", run_id=run.run_id)
        await released.wait()

    def import_done_blocking(run, result) -> None:  # a synchronous client, say
        get_logger().info("test.hook_called", run_id=run.run_id)
        time.sleep(float(os.environ["HOOK_BLOCKS_S"]))

    async def import_done_raising(run, result) -> None:
        get_logger().info("test.hook_called", run_id=run.run_id)
        raise RuntimeError("the import's downstream is down")

    function: HookFunction
    if "HOOK_BLOCKS_S" in os.environ:
        function = import_done_blocking
    elif "HOOK_RAISES" in os.environ:
        function = import_done_raising
    else:
        function = import_done
    async with connect() as tether:  # its settings from the environment
        hooks = tether.hooks(PARENT_AGENT)
        hooks.register(METHOD, function)
        await hooks.serve(stop)


if __name__ == "__main__":
    asyncio.run(main())
