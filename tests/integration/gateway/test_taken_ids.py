"""An id a caller used before, sent again for another call, over real HTTP: an A2A message
id sent to another agent or with other content, an MCP run id (`_meta`) used for another
tool or other arguments. Each is refused (-32602, or a tool error saying why), never
answered with the first call's task or result; the same call sent again still is."""

import uuid
from collections.abc import AsyncIterator

import gateway_agents
import pytest
from gateway_stack import DESKTOP, a2a_rpc, mcp_client, running_gateway
from mcp.shared.exceptions import MCPError

from tether.remote.mcp_tasks import RUN_ID_META, CreatedTask, TasksExtension

INVALID_PARAMS = -32602


@pytest.fixture
async def mcp_url(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as url:
        yield url


def message(data: dict, message_id: str) -> dict:
    return {"message": {"role": "ROLE_USER", "messageId": message_id,
                        "parts": [{"data": data}]}}


async def test_an_a2a_message_id_sent_again_for_another_call_is_refused(mcp_url):
    base, message_id = mcp_url.removesuffix("/mcp"), uuid.uuid4().hex
    first = await a2a_rpc(base, "Researcher", "SendMessage",
                          message({"query": "first"}, message_id))
    task = first["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", first

    for agent_type, data, why in (
            ("Failing", {}, "of Researcher, not Failing"),
            ("Researcher", {"query": "second"}, "with other input")):
        refused = await a2a_rpc(base, agent_type, "SendMessage", message(data, message_id))
        assert refused.get("error", {}).get("code") == INVALID_PARAMS, refused
        assert message_id in refused["error"]["message"] and why in refused["error"]["message"]

    again = await a2a_rpc(base, "Researcher", "SendMessage",
                          message({"query": "first"}, message_id))
    assert again["result"]["task"]["id"] == task["id"], "the same message again"
    assert again["result"]["task"]["artifacts"] == task["artifacts"]


async def test_an_mcp_run_id_used_again_for_another_call_is_refused(mcp_url):
    meta = {RUN_ID_META: f"mcp-{uuid.uuid4().hex}"}
    async with mcp_client(mcp_url, DESKTOP) as client:
        first = await client.call_tool("Researcher", {"query": "alpha"}, meta=meta)
        assert first.structured_content["summary"] == "alpha: two sources agree"
        other_input = await client.call_tool("Researcher", {"query": "beta"}, meta=meta)
        other_tool = await client.call_tool("Failing", {}, meta=meta)
        again = await client.call_tool("Researcher", {"query": "alpha"}, meta=meta)
    for refused, why in ((other_input, "with other input"),
                         (other_tool, "of Researcher, not Failing")):
        assert refused.is_error, refused
        assert why in refused.content[0].text
        assert "alpha" not in refused.content[0].text, "never the first call's result"
    assert again.structured_content == first.structured_content


async def test_an_mcp_task_with_a_run_id_of_another_call_is_refused(mcp_url):
    meta = {RUN_ID_META: f"mcp-{uuid.uuid4().hex}"}
    async with mcp_client(mcp_url, DESKTOP) as client:
        assert not (await client.call_tool("Researcher", {"query": "alpha"}, meta=meta)).is_error
    async with mcp_client(mcp_url, DESKTOP, extensions=[TasksExtension()]) as client:
        with pytest.raises(MCPError, match="of Researcher, not Held"):
            await client.session.call_tool("Held", {}, allow_claimed=True, meta=meta)
        created = await client.session.call_tool(
            "Held", {}, allow_claimed=True, meta={RUN_ID_META: f"mcp-{uuid.uuid4().hex}"})
        assert isinstance(created, CreatedTask) and created.status == "working"
    gateway_agents.RELEASE.set()
