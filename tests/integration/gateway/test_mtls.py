"""The gateway over HTTPS, letting callers in by their TLS client certificate (mTLS) as well
as by their bearer token, against the official MCP SDK's client: a certificate in the
callers file is that caller, a verified certificate nobody has is refused (401), one
another CA signed does not get through the handshake, and a token still works."""

import ssl
from collections.abc import AsyncIterator

import httpx2
import pytest
from gateway_stack import DESKTOP, running_gateway, sha
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from test_certs import make_certificates

from tether.domain.events import ParentRef
from tether.gateway.callers import load_callers, main
from tether.gateway.server import GatewaySettingsError, server_tls

ROBOT_PARENT = ParentRef(agent="Gateway", name="robot")


@pytest.fixture
def certificates(tmp_path):
    server = make_certificates(tmp_path / "ca", name="gateway")
    robot = make_certificates(tmp_path / "ca", name="robot", ca=server)
    stranger = make_certificates(tmp_path / "ca", name="stranger", ca=server)
    elsewhere = make_certificates(tmp_path / "other-ca", name="robot")
    return {"server": server, "robot": robot, "stranger": stranger, "elsewhere": elsewhere}


@pytest.fixture
def gateway_settings(gateway_settings, certificates, tmp_path):
    callers = tmp_path / "mtls-callers.toml"
    callers.write_text(f'''
[[caller]]
name = "desktop"
token_sha256 = "{sha(DESKTOP)}"

[[caller]]
name = "robot"
client_cert_sha256 = "{main(["--cert", str(certificates["robot"].cert)])}"
''')
    server = certificates["server"]
    return gateway_settings.model_copy(update={
        "gateway_callers_file": str(callers), "gateway_tls_cert_file": str(server.cert),
        "gateway_tls_key_file": str(server.key), "gateway_tls_client_ca_file": str(server.ca)})


@pytest.fixture
async def gateway(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as url:
        yield url.replace("http://", "https://")


def client_tls(certificates, who: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certificates["server"].ca))
    if who is not None:
        context.load_cert_chain(str(certificates[who].cert), str(certificates[who].key))
    return context


async def test_a_caller_is_let_in_by_its_client_certificate(gateway, certificates, log):
    async with (httpx2.AsyncClient(verify=client_tls(certificates, "robot"), timeout=30) as http,
                Client(streamable_http_client(gateway, http_client=http)) as client):
        tools = {tool.name for tool in (await client.list_tools()).tools}
        result = await client.call_tool("Researcher", {"query": "mTLS"},
                                        meta={"io.tether/run_id": "by-certificate"})
    assert "Researcher" in tools
    assert not result.is_error, result
    run = await log.read_run(ROBOT_PARENT, "by-certificate")
    assert run.state is not None and run.state.status == "completed"


async def test_a_certificate_nobody_has_is_refused_and_a_token_still_works(
        gateway, certificates):
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    for who in ("stranger", None):
        async with httpx2.AsyncClient(verify=client_tls(certificates, who)) as http:
            refused = await http.post(gateway, json=ping)
        assert refused.status_code == 401, (who, refused.text)
    async with httpx2.AsyncClient(verify=client_tls(certificates, None),
                                  headers={"Authorization": f"Bearer {DESKTOP}"}) as http:
        assert (await http.post(gateway, json=ping)).status_code != 401
    # A known certificate does not make a wrong token good.
    async with httpx2.AsyncClient(verify=client_tls(certificates, "robot"),
                                  headers={"Authorization": "Bearer wrong"}) as http:
        assert (await http.post(gateway, json=ping)).status_code == 401


async def test_a_certificate_another_ca_signed_does_not_get_through_the_handshake(
        gateway, certificates):
    async with httpx2.AsyncClient(verify=client_tls(certificates, "elsewhere")) as http:
        with pytest.raises(httpx2.TransportError):
            await http.post(gateway, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})


def test_certificate_callers_need_the_client_ca_setting(gateway_settings):
    callers = load_callers(gateway_settings.gateway_callers_file)
    with pytest.raises(GatewaySettingsError, match="set TETHER_GATEWAY_TLS_CLIENT_CA_FILE"):
        server_tls(gateway_settings.model_copy(update={"gateway_tls_client_ca_file": None}),
                   callers)
    with pytest.raises(GatewaySettingsError, match="TETHER_GATEWAY_TLS_KEY_FILE together"):
        server_tls(gateway_settings.model_copy(update={"gateway_tls_key_file": None}), callers)
