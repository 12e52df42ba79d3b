"""A hook handler paused (SIGSTOP) with a hook just delivered to it, past its lease: the
server hands the hook to another handler, which calls the function. Woken while that call
is still under way, the paused handler does not call the function a second time: it
leaves the hook to its redelivery, and the function runs once."""

import json
import signal

from eventually import eventually
from hook_handlers import HookHandlerProcess
from service_processes import support_path

from tether.adapters.hook_consumers import consumer_name
from tether.adapters.nats_connection import connect_nats
from tether.contract.messages import FIRST_PUBLICATION_HEADER, HookMessage, LifecycleResult, RunInfo
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef
from tether.domain.ids import finish_message_id
from tether.testing import RunEvents

PARENT = ParentRef(agent="Importer", name="acme")
METHOD = "on_import_done"
LEASE_MS = 1500


async def test_a_hook_handler_paused_past_its_lease_does_not_call_the_function_again(
        log, services, service_env, settings):
    env = {**service_env, "TETHER_HOOK_LEASE_MS": str(LEASE_MS),
           "PYTHONPATH": support_path()}
    await services("parent")  # it makes the buckets, and records the deliveries
    handlers = [HookHandlerProcess(env)]
    nc = await connect_nats(settings.nats_url, name="tether-e2e-hooks")
    try:
        paused = await handlers[0].start()
        stream, consumer = log.subjects.hooks_stream, consumer_name(PARENT.agent, METHOD)

        async def consumer_info():
            return await nc.jetstream().consumer_info(stream, consumer)

        await eventually(lambda: consumer_info_has(consumer_info, num_waiting=1), timeout=30)
        paused.signal(signal.SIGSTOP)
        try:
            run = RunEvents("import-1", PARENT)
            for event in (run.requested("ImportAgent",
                                        detached=DetachedOptions(on_finish=METHOD)),
                          run.started(), run.running(), run.completed("imported")):
                await log.append(event, expected_last_seq=None)
            state = (await log.read_run(PARENT, "import-1")).state
            hook = HookMessage(method=METHOD, run=RunInfo.of(state),
                               result=LifecycleResult.of(state))
            await log.jetstream.publish(
                log.subjects.hook(PARENT.agent, METHOD), hook.model_dump_json().encode(),
                headers={"Nats-Msg-Id": finish_message_id(state, state.status, METHOD),
                         FIRST_PUBLICATION_HEADER: "1"}, stream=stream)
            # Delivered to the paused handler's waiting fetch.
            await eventually(lambda: consumer_info_has(consumer_info, num_ack_pending=1,
                                                       num_pending=0), timeout=30)
            other = HookHandlerProcess(env)
            handlers.append(other)
            await other.start()

            # Its lease ran out: the other handler has the hook, and calls the function.
            await other.logged("test.hook_called", timeout=30)
        finally:
            paused.signal(signal.SIGCONT)
        [left] = await paused.logged("hooks.left_to_redelivery", timeout=30)
        other.signal(signal.SIGUSR1)  # the function returns
        await other.logged("hooks.delivered", timeout=30)
    finally:
        for handler in handlers:
            await handler.stop()
            print(f"--- hook handler {handler.pid} ---")  # shown when the test failed
            for line in handler.lines[-200:]:
                print(json.dumps(line))
        await nc.close()
    assert left["run_id"] == "import-1", left
    called = [(handler.pid, line["run_id"]) for handler in handlers for line in handler.lines
              if line.get("event") == "test.hook_called"]
    assert called == [(other.pid, "import-1")]
    assert not [line for line in paused.lines if line.get("event") == "hooks.delivered"]
    history = await log.read_run(PARENT, "import-1")
    assert [e.type for e in history.events].count("run.finish_delivered") == 1


async def consumer_info_has(info, **expected: int) -> bool:
    got = await info()
    return all(getattr(got, name) == value for name, value in expected.items())
