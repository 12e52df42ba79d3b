"""Hook handlers as processes (tests/support/hook_handler_process.py), and what the tests
that pause them share: a finished detached run of the handler's parent agent and its
hook, published as its writer would."""

import json
import sys
import time

from service_processes import SUPPORT, ServiceProcess

from tether.contract.messages import FIRST_PUBLICATION_HEADER, HookMessage, LifecycleResult, RunInfo
from tether.domain.detached_options import DetachedOptions
from tether.domain.events import ParentRef
from tether.domain.ids import finish_message_id
from tether.testing import RunEvents

PARENT = ParentRef(agent="Importer", name="acme")  # hook_handler_process.py's
METHOD = "on_import_done"


class HookHandlerProcess(ServiceProcess):
    """tests/support/hook_handler_process.py, its JSON log lines collected; started once
    it serves."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__("hook-handler", env)

    async def start(self) -> "HookHandlerProcess":
        await self._spawn(sys.executable, str(SUPPORT / "hook_handler_process.py"))
        await self.logged("hooks.serving", timeout=30)
        return self

    def called(self) -> list[str]:
        """The run ids its function was called for, in order."""
        return [line["run_id"] for line in self.lines if line.get("event") == "test.hook_called"]

    def print_lines(self) -> None:
        print(f"--- hook handler {self.pid} ---")  # shown when the test failed
        for line in self.lines[-200:]:
            print(json.dumps(line))


async def finish_detached_run(log, run_id: str) -> None:
    """A detached run of `PARENT` naming `METHOD`, ended `completed` now (the reconciler
    publishes its hook again a delivery lease after that), with no hook yet."""
    run = RunEvents(run_id, PARENT, start_ms=int(time.time() * 1000))
    for event in (run.requested("ImportAgent", detached=DetachedOptions(on_finish=METHOD)),
                  run.started(), run.running(), run.completed("imported")):
        await log.append(event, expected_last_seq=None)


async def publish_finish_hook(log, run_id: str) -> None:
    """The run's hook, as its writer publishes it right after the outcome."""
    state = (await log.read_run(PARENT, run_id)).state
    hook = HookMessage(method=METHOD, run=RunInfo.of(state), result=LifecycleResult.of(state))
    await log.jetstream.publish(
        log.subjects.hook(PARENT.agent, METHOD), hook.model_dump_json().encode(),
        headers={"Nats-Msg-Id": finish_message_id(state, state.status, METHOD),
                 FIRST_PUBLICATION_HEADER: "1"}, stream=log.subjects.hooks_stream)

