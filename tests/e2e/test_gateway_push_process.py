"""A2A push notifications from gateway processes, one paused (SIGSTOP) past its lease
while it sends a notification the receiver holds: another gateway takes the config over,
sends that notification again (the same id) and the task's later states to its end.
Woken, the paused gateway finds the config taken over: it sends nothing more for it, and
leaves the config as the other recorded it (done)."""

import asyncio
import signal
import uuid
from typing import Any

from a2a.types import (
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    TaskPushNotificationConfig,
)
from eventually import eventually
from gateway_stack import DESKTOP, a2a_client, sha
from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Value
from push_receiver import Receiver
from service_processes import support_path

from tether.gateway.a2a_push import NOTIFICATION_ID_HEADER

LEASE_MS = 3000


def message(data: dict[str, Any], *, task_id: str = "",
            push: TaskPushNotificationConfig | None = None) -> SendMessageRequest:
    configuration = SendMessageConfiguration(return_immediately=True)
    if push is not None:
        configuration.task_push_notification_config.CopyFrom(push)
    return SendMessageRequest(message=Message(
        role=Role.ROLE_USER, message_id=uuid.uuid4().hex, task_id=task_id,
        parts=[Part(data=ParseDict(data, Value()))]), configuration=configuration)


async def send(base: str, request: SendMessageRequest) -> str:
    async with a2a_client(base, "Approver", DESKTOP, streaming=False) as client:
        [response] = [r async for r in client.send_message(request)]
    return response.task.id


async def base_of(gateway) -> str:
    [listening] = await gateway.logged("gateway.listening", timeout=30)
    return listening["mcp"].removesuffix("/mcp")


async def test_a_gateway_paused_past_its_push_lease_sends_nothing_more_when_it_wakes(
        log, pool, services, settings, tmp_path):
    callers = tmp_path / "callers.toml"
    callers.write_text(f'[[caller]]\nname = "desktop"\ntoken_sha256 = "{sha(DESKTOP)}"\n')
    env = {"TETHER_AGENTS": "gateway_agents:Approver", "TETHER_WORK_ACK_WAIT_MS": "1500",
           "PYTHONPATH": support_path()}
    gateway_env = {**env, "TETHER_GATEWAY_CALLERS_FILE": str(callers),
                   "TETHER_GATEWAY_PORT": "0", "TETHER_GATEWAY_PUSH_LEASE_MS": str(LEASE_MS),
                   "TETHER_GATEWAY_PUSH_PRIVATE_URLS": "true"}
    async with Receiver(hold_first=True) as receiver:
        _, _, paused = await asyncio.gather(services("parent", **env),
                                            services("child-runner", **env),
                                            services("gateway", **gateway_env))
        task_id = await send(await base_of(paused),
                             message({}, push=TaskPushNotificationConfig(url=receiver.url)))
        await eventually(lambda: len(receiver.received) == 1, timeout=30)
        paused.signal(signal.SIGSTOP)  # while the receiver holds its first notification
        try:
            other = await services("gateway", **gateway_env)
            base = await base_of(other)

            def asking() -> bool:  # the other sent the held one again, then the question
                return receiver.states()[-1:] == ["TASK_STATE_INPUT_REQUIRED"] and len(
                    receiver.received) > 1

            await eventually(asking, timeout=30)
            await send(base, message({"approvals": ["publish"]}, task_id=task_id))
            await eventually(lambda: receiver.states()[-1:] == ["TASK_STATE_COMPLETED"],
                             timeout=30)
            sent_by_the_other = list(receiver.received)
            receiver.release()  # the paused gateway's notification is taken
        finally:
            paused.signal(signal.SIGCONT)
        [taken] = await paused.logged("push.taken_over", timeout=30)

    assert taken["task_id"] == task_id, taken
    assert receiver.received == sent_by_the_other, "the woken gateway sent nothing more"
    ids = [headers[NOTIFICATION_ID_HEADER.lower()] for headers, _ in receiver.received]
    assert ids[0] == ids[1] == f"{task_id}:default:1", ids  # the held one, sent again
    assert ids[1:] == [f"{task_id}:default:{n}" for n in range(1, len(ids))], ids
    assert len({(i, s) for i, s in zip(ids, receiver.states(), strict=True)}) == len(ids) - 1
    row = await pool.fetchrow(
        f'SELECT done, sent_count, pending_id FROM "{settings.projection_schema}_gateway"'
        ".push_configs WHERE task_id = $1", task_id)
    assert dict(row) == {"done": True, "sent_count": len(ids) - 1, "pending_id": None}
    # What the paused gateway says: the held notification was taken, and then nothing.
    assert [(line["event"], line.get("notification_id")) for line in paused.lines
            if line["event"].startswith("push.")] == [
        ("push.sent", f"{task_id}:default:1"), ("push.taken_over", None)]
