"""A2A push notifications against the official SDK's client, over real HTTP, to a receiver
of the test's: a config set with a message or on a task is kept in Postgres, each change
of the task's state is POSTed to it, and a receiver that is down, through a gateway that
restarts, still gets every notification, the same one with the same id."""

import uuid
from collections.abc import AsyncIterator

import gateway_agents
import pytest
from a2a.types import (
    AuthenticationInfo,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import A2AError
from eventually import eventually
from gateway_stack import LIMITED, a2a_client, a2a_rpc, running_gateway
from push_receiver import Receiver

from tether.adapters.postgres.push_configs import PushConfig, PushConfigs
from tether.gateway.a2a_push import NOTIFICATION_ID_HEADER


@pytest.fixture
def gateway_settings(gateway_settings):
    return gateway_settings.model_copy(update={"gateway_push_private_urls": True})


@pytest.fixture
async def base(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as mcp_url:
        yield mcp_url.removesuffix("/mcp")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with Receiver() as started:
        yield started


def message(text: str, push: TaskPushNotificationConfig | None = None) -> SendMessageRequest:
    configuration = SendMessageConfiguration(return_immediately=True)
    if push is not None:
        configuration.task_push_notification_config.CopyFrom(push)
    return SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex,
                                              parts=[Part(text=text)]),
                              configuration=configuration)


async def send(base: str, agent_type: str, request: SendMessageRequest) -> str:
    async with a2a_client(base, agent_type, streaming=False) as client:
        [response] = [r async for r in client.send_message(request)]
    return response.task.id


async def test_a_config_set_with_the_message_gets_each_state_to_the_end(base, receiver):
    push = TaskPushNotificationConfig(
        url=receiver.url, token="receiver-token",
        authentication=AuthenticationInfo(scheme="Bearer", credentials="for-the-receiver"))
    task_id = await send(base, "Researcher", message("HTTP/3", push))

    async def completed():
        return receiver.states()[-1:] == ["TASK_STATE_COMPLETED"]

    await eventually(completed, timeout=20)
    states = receiver.states()
    assert states == sorted(set(states), key=states.index), "each state once"
    ids = [headers[NOTIFICATION_ID_HEADER.lower()] for headers, _ in receiver.received]
    assert ids == [f"{task_id}:default:{n}" for n in range(1, len(ids) + 1)]
    for headers, body in receiver.received:
        assert headers["x-a2a-notification-token"] == "receiver-token"
        assert headers["authorization"] == "Bearer for-the-receiver"
        assert body["task"]["id"] == task_id
    final = receiver.received[-1][1]["task"]
    assert [a["name"] for a in final["artifacts"]][-1] == "result"


async def test_a_receiver_that_is_down_gets_it_later_through_a_gateway_restart(
        services, gateway_settings, receiver):
    receiver.down = True
    async with running_gateway(gateway_settings) as mcp_url:
        base = mcp_url.removesuffix("/mcp")
        task_id = await send(base, "Held", message("hold"))
        async with a2a_client(base, "Held") as client:
            async def working() -> bool:  # the runner has taken the task
                task = await client.get_task(GetTaskRequest(id=task_id))
                return task.status.state == TaskState.TASK_STATE_WORKING

            await eventually(working)
            await client.create_task_push_notification_config(TaskPushNotificationConfig(
                task_id=task_id, id="mine", url=receiver.url))

        async def refused():
            return receiver.refused >= 2  # tried, and tried again

        await eventually(refused, timeout=20)
    gateway_agents.RELEASE.set()  # the task ends while no gateway runs
    receiver.down = False
    async with running_gateway(gateway_settings):
        async def completed():
            return receiver.states()[-1:] == ["TASK_STATE_COMPLETED"]

        await eventually(completed, timeout=30)
    ids = [headers[NOTIFICATION_ID_HEADER.lower()] for headers, _ in receiver.received]
    # The notification refused before the restart is the first taken after it.
    assert ids[0] == f"{task_id}:mine:1" and receiver.states()[0] == "TASK_STATE_WORKING"
    assert len(ids) == len(set(ids))


async def test_configs_are_the_callers_own(base, receiver):
    task_id = await send(base, "Researcher", message("gRPC"))
    async with a2a_client(base, "Researcher") as client:
        made = await client.create_task_push_notification_config(TaskPushNotificationConfig(
            task_id=task_id, id="one", url=receiver.url, token="t"))
        assert (made.id, made.task_id, made.url, made.token) == ("one", task_id,
                                                                 receiver.url, "t")
        got = await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task_id, id="one"))
        assert got == made
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id))
        assert list(listed.configs) == [made]
    async with a2a_client(base, "Researcher", LIMITED) as other:
        with pytest.raises(A2AError, match=f"no task {task_id}"):
            await other.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task_id))
    async with a2a_client(base, "Researcher") as client:
        await client.delete_task_push_notification_config(
            DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="one"))
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id))
        assert list(listed.configs) == []
        with pytest.raises(A2AError, match="url: a push notification URL is http"):
            await client.create_task_push_notification_config(TaskPushNotificationConfig(
                task_id=task_id, id="two", url="ftp://example.com/x"))


async def test_private_addresses_are_refused_unless_allowed(services, gateway_settings, receiver):
    closed = gateway_settings.model_copy(update={"gateway_push_private_urls": False})
    async with running_gateway(closed) as mcp_url:
        base = mcp_url.removesuffix("/mcp")
        with pytest.raises(A2AError, match="TETHER_GATEWAY_PUSH_PRIVATE_URLS"):
            await send(base, "Researcher", message("x", TaskPushNotificationConfig(
                url=receiver.url)))


@pytest.mark.parametrize(("config", "named"), [
    ({"token": "a\r\nX-Injected: 1"}, "token: holds a control character"),
    ({"authentication": {"scheme": "Bearer", "credentials": "a\nb"}},
     "authentication.credentials: holds a control character"),
    ({"id": "two words"}, "invalid id (the push notification config's) 'two words'"),
    ({"id": "a\r\nb"}, "invalid id (the push notification config's)"),
    ({"url": "http://"}, "url: 'http://' names no valid host"),
    ({"url": "http://[::1"}, "url: 'http://[::1' is not a URL"),
    ({"url": "http://exa mple.com/x"}, "url: 'http://exa mple.com/x' holds a space"),
    ({"url": "http://127.0.0.1:99999/x"}, "outside 1..65535"),
])
async def test_a_config_that_could_never_be_sent_is_refused(base, receiver, config, named):
    """Private URLs are allowed here: the URL is checked all the same."""
    task_id = await send(base, "Researcher", message("gRPC"))
    refused = await a2a_rpc(base, "Researcher", "CreateTaskPushNotificationConfig",
                            {"taskId": task_id, "url": receiver.url, **config})
    assert refused["error"]["code"] == -32602, refused
    assert named in refused["error"]["message"]
    async with a2a_client(base, "Researcher") as client:
        listed = await client.list_task_push_notification_configs(
            ListTaskPushNotificationConfigsRequest(task_id=task_id))
    assert list(listed.configs) == []


async def test_a_kept_config_that_can_never_be_sent_is_finished_saying_why(
        base, receiver, pool, settings):
    """A config kept before the gateway checked configs (a token a header cannot carry)
    fails the same way each time: it is finished, not sent again for ever."""
    task_id = await send(base, "Researcher", message("gRPC"))
    store = PushConfigs(pool, settings.projection_schema)
    await store.put(PushConfig(caller="desktop", task_id=task_id, config_id="old",
                               url=receiver.url, token="bad\r\ntoken"))

    async def finished():
        return await pool.fetchrow(
            f'SELECT done, failures, last_error FROM "{store.schema}".push_configs WHERE'
            " task_id = $1 AND config_id = 'old' AND done", task_id)

    row = await eventually(finished, timeout=20)
    assert row["failures"] == 0 and "LocalProtocolError" in row["last_error"]
    assert "can never be sent" in row["last_error"]
    assert receiver.received == []
