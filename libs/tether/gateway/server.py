"""The gateway's HTTP app and its service: the child agents as MCP tools at `/mcp` and as
A2A agents under `/a2a/<agent type>/`, for the callers of the callers file only.

Every request but `/healthz` and the A2A agent cards carries a caller's bearer token; an unknown or missing one
is refused with 401 before any protocol sees it. Each caller's calls go to Tether over
its own NATS identity when it has one (its application's, so the broker checks them as
it checks the application), else over the gateway's.
"""

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tether.extras import MissingExtra

try:
    import httpx
    from a2a.server.routes import create_agent_card_routes, create_rest_routes
    from mcp.server.auth.middleware.auth_context import AuthContextMiddleware
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
    from mcp.server.auth.provider import AccessToken
    from starlette.applications import Starlette
    from starlette.authentication import AuthCredentials
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware
    from starlette.requests import HTTPConnection, Request
    from starlette.responses import JSONResponse
    from starlette.routing import Mount, Route
    from starlette.types import ASGIApp, Receive, Scope, Send

    from tether.asgi_serving import ServerTLS, listen_on, serve_app
    from tether.gateway.a2a_agents import TetherAgentHandler, agent_card
    from tether.gateway.a2a_push import Pusher, Pushes
    from tether.gateway.a2a_requests import NamedParamsDispatcher
    from tether.gateway.mcp_tools import McpTools
except ModuleNotFoundError:
    raise MissingExtra("gateway") from None

from tether.adapters.postgres.push_configs import PushConfigs
from tether.agent_registry import AgentConfigurationError, AgentRegistry
from tether.child.loading import load_agents
from tether.client.connection import Tether, connect
from tether.client.errors import ServiceUnavailable
from tether.client.parent import ParentHandle
from tether.config import Settings
from tether.diagnose import CannotListen, StartupFailed, is_address_in_use
from tether.gateway.callers import Caller, Callers, CallersFileError, load_callers
from tether.log import get_logger
from tether.runtime import (
    ReadinessCheck,
    close_quietly,
    nats_check,
    open_postgres,
    postgres_check,
    while_starting,
)

OPEN_PATHS = frozenset({"/healthz"})
CARD_PATH = "/.well-known/agent-card.json"  # each A2A agent's, readable by anyone
SCOPE = "tether"


class CallersVerifier:
    """The MCP SDK's token verifier over the callers file: a token is a caller's or
    nobody's."""

    def __init__(self, callers: Callers) -> None:
        self._callers = callers

    async def verify_token(self, token: str) -> AccessToken | None:
        caller = self._callers.by_token(token)
        if caller is None:
            return None
        return AccessToken(token="", client_id=caller.name, scopes=[SCOPE])


class CallersBackend(BearerAuthBackend):
    """A caller by its bearer token, or, for a request without one, by the client
    certificate the TLS handshake verified."""

    def __init__(self, callers: Callers) -> None:
        super().__init__(CallersVerifier(callers))
        self._callers = callers

    async def authenticate(self, conn: HTTPConnection):
        if "authorization" in conn.headers:
            return await super().authenticate(conn)  # a wrong token is not made good
        chain = ((conn.scope.get("extensions") or {}).get("tls") or {}).get("client_cert_chain")
        caller = self._callers.by_certificate(chain[0]) if chain else None
        if caller is None:
            return None
        return (AuthCredentials([SCOPE]),
                AuthenticatedUser(AccessToken(token="", client_id=caller.name, scopes=[SCOPE])))


class RequireCaller:
    """Refuses every request without a known caller (401), but the open paths."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] == "http" and path not in OPEN_PATHS
                and not path.endswith(CARD_PATH)
                and not isinstance(scope.get("user"), AuthenticatedUser)):
            response = JSONResponse(
                {"error": "invalid_token",
                 "error_description": "a bearer token of a caller of this gateway is "
                                      "required (Authorization: Bearer <token>)"},
                status_code=401, headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Connections:
    """One Tether connection per NATS identity the callers use (the gateway's own for
    those without one), opened at start."""

    def __init__(self, settings: Settings, callers: Callers) -> None:
        self._settings = settings
        self._identities = {caller.identity for caller in callers.all}
        self._open: dict[tuple[str | None, str | None], Tether] = {}

    async def open(self) -> None:
        for identity in sorted(self._identities, key=lambda i: (i[0] or "", i[1] or "")):
            if identity in self._open:
                continue
            seed, creds = identity
            settings = self._settings
            if seed or creds:
                settings = settings.model_copy(update={
                    "nats_nkey_seed_file": seed, "nats_creds_file": creds,
                    "nats_user": None, "nats_password": None})
            self._open[identity] = await connect(
                settings=settings, name="tether-gateway",
                connect_timeout=settings.startup_timeout_ms / 1000)

    def parent_of(self, caller: Caller) -> ParentHandle:
        return self._open[caller.identity].parent(caller.parent.agent, caller.parent.name)

    def checks(self) -> dict[str, ReadinessCheck]:
        return {f"gateway_nats_{index}": nats_check(tether.nc)
                for index, tether in enumerate(self._open.values())}

    async def close(self) -> None:
        for tether in self._open.values():
            with contextlib.suppress(Exception):
                await tether.close()
        self._open.clear()


def a2a_routes(agents: AgentRegistry, callers: Callers, connections: Connections,
               base_url: str, logger, stopping: asyncio.Event,
               pushes: Pushes | None) -> list[Mount]:
    """Each agent type as an A2A agent under `/a2a/<agent type>`."""
    mounts = []
    for agent_type in agents.agent_types:
        cls = agents.get(agent_type)
        handler = TetherAgentHandler(agent_type, cls, callers, connections.parent_of, logger,
                                     stopping=stopping, pushes=pushes)
        mounts.append(Mount(f"/a2a/{agent_type}", routes=[
            *create_agent_card_routes(agent_card(agent_type, cls, base_url)),
            Route("/jsonrpc", endpoint=NamedParamsDispatcher(handler).handle_requests,
                  methods=["POST"]),
            *create_rest_routes(handler, path_prefix="/rest")]))
    return mounts


def create_app(settings: Settings, agents: AgentRegistry, callers: Callers,
               connections: Connections, logger, *, base_url: str,
               stopping: asyncio.Event, pushes: Pushes | None = None) -> Starlette:
    """`base_url`: where callers reach the gateway (the A2A cards name it); `stopping`,
    set when the gateway stops, ends the calls and streams under way (their runs go
    on); `pushes`: where A2A push notification configs are kept."""
    mcp = McpTools(agents, callers, connections.parent_of, logger, stopping=stopping)
    mcp_app = mcp.server.streamable_http_app(streamable_http_path="/mcp",
                                             host=settings.gateway_host)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp.server.session_manager.run():
            yield

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[Route("/healthz", healthz),
                *a2a_routes(agents, callers, connections, base_url, logger, stopping, pushes),
                Mount("/", app=mcp_app)],
        middleware=[Middleware(AuthenticationMiddleware, backend=CallersBackend(callers)),
                    Middleware(AuthContextMiddleware), Middleware(RequireCaller)],
        lifespan=lifespan)


def _configuration(settings: Settings, logger) -> tuple[AgentRegistry, Callers]:
    """The agent types served and the callers let in; what is wrong stops the gateway
    with one line naming the setting."""
    try:
        agents = load_agents(settings.agents)
        if not agents:
            raise AgentConfigurationError(
                "no agent types to serve: set TETHER_AGENTS or pass --agents module:Class")
        if settings.gateway_callers_file is None:
            raise CallersFileError(
                "no callers: set TETHER_GATEWAY_CALLERS_FILE to the callers file (the "
                "gateway lets nobody in without one)")
        callers = load_callers(settings.gateway_callers_file)
        server_tls(settings, callers)
    except (AgentConfigurationError, CallersFileError, GatewaySettingsError) as error:
        logger.error("gateway.misconfigured", error=str(error))
        raise SystemExit(2) from None
    return agents, callers


class GatewaySettingsError(ValueError):
    """A gateway setting that cannot be used; the message names it."""


def server_tls(settings: Settings, callers: Callers) -> ServerTLS | None:
    """The gateway's HTTPS, from its settings; `GatewaySettingsError` names a setting that
    is missing or a file that cannot be read."""
    cert, key = settings.gateway_tls_cert_file, settings.gateway_tls_key_file
    client_ca = settings.gateway_tls_client_ca_file
    if (cert is None) != (key is None):
        raise GatewaySettingsError("set TETHER_GATEWAY_TLS_CERT_FILE and TETHER_GATEWAY_TLS_KEY_FILE "
                               "together (the gateway's certificate and its key)")
    if client_ca is not None and cert is None:
        raise GatewaySettingsError("TETHER_GATEWAY_TLS_CLIENT_CA_FILE asks for client "
                               "certificates over HTTPS: set TETHER_GATEWAY_TLS_CERT_FILE and "
                               "TETHER_GATEWAY_TLS_KEY_FILE too")
    if callers.with_certificates and client_ca is None:
        raise GatewaySettingsError("a caller has client_cert_sha256, but the gateway asks for no "
                               "client certificates: set TETHER_GATEWAY_TLS_CLIENT_CA_FILE to "
                               "the CA that signs them")
    for variable, path in (("TETHER_GATEWAY_TLS_CERT_FILE", cert),
                           ("TETHER_GATEWAY_TLS_KEY_FILE", key),
                           ("TETHER_GATEWAY_TLS_CLIENT_CA_FILE", client_ca)):
        if path is not None and not os.access(path, os.R_OK):
            raise GatewaySettingsError(f"{variable}: {path} is not a readable file")
    if cert is None or key is None:
        return None
    return ServerTLS(cert, key, client_ca)


async def serve_gateway(settings: Settings, stop: asyncio.Event,
                        checks: dict[str, ReadinessCheck], *,
                        listener: socket.socket | None = None,
                        started: asyncio.Future | None = None) -> None:
    """Serve until `stop` is set; `started` gets the bound port once it serves."""
    logger = get_logger(service="gateway")
    agents, callers = _configuration(settings, logger)
    host, port = settings.gateway_host, settings.gateway_port
    if listener is None:
        try:
            listener = listen_on(host, port)
        except OSError as error:
            raise CannotListen(
                f"cannot serve the gateway on {host}:{port}: "
                + ("the port is in use; set TETHER_GATEWAY_PORT to a free port, or 0 for any"
                   if is_address_in_use(error) else
                   f"{error.strerror or error}; check TETHER_GATEWAY_HOST and "
                   "TETHER_GATEWAY_PORT")) from None
    connections = Connections(settings, callers)
    pool = None
    try:
        try:
            await connections.open()
        except ServiceUnavailable as error:
            raise StartupFailed(str(error)) from None
        pool = await open_postgres(settings, stop, min_size=1, max_size=4)
        if pool is None:
            return
        store = PushConfigs(pool, settings.projection_schema)
        if not await while_starting(settings, stop, "creating the push configs table",
                                    store.prepare):
            return
        tls = server_tls(settings, callers)
        bound_host, bound_port = listener.getsockname()[:2]
        base_url = (settings.gateway_public_url
                    or f"{'https' if tls else 'http'}://"
                       f"{f'[{bound_host}]' if ':' in bound_host else bound_host}"
                       f":{bound_port}").rstrip("/")
        stopping = asyncio.Event()
        pusher = Pusher(store, callers, connections.parent_of, logger,
                        owner=f"gateway-{uuid.uuid4().hex[:12]}",
                        http=httpx.AsyncClient(timeout=30.0),
                        lease_s=settings.gateway_push_lease_ms / 1000)
        pushes = Pushes(store, pusher, private_urls=settings.gateway_push_private_urls)
        app = create_app(settings, agents, callers, connections, logger, base_url=base_url,
                         stopping=stopping, pushes=pushes)

        def listening(port: int) -> None:
            checks.update(connections.checks())
            checks["gateway_postgres"] = postgres_check(pool)
            logger.info("gateway.listening", host=bound_host, port=port,
                        mcp=f"{base_url}/mcp", a2a=f"{base_url}/a2a/<agent type>",
                        agents=agents.agent_types,
                        callers=len(callers))
            if started is not None and not started.done():
                started.set_result(port)

        pushing = asyncio.create_task(pusher.run(stopping))
        try:
            await serve_app(app, listener, stop, what="the gateway", listening=listening,
                            stopping=stopping.set, tls=tls)
        finally:
            stopping.set()
            await pushing
            await pusher.http.aclose()
    finally:
        listener.close()
        if pool is not None:
            await close_quietly(pool.close())
        await connections.close()


async def serve(settings: Settings, stop: asyncio.Event, checks: dict[str, Any]) -> None:
    """The `gateway` service of `tether services`."""
    await serve_gateway(settings, stop, checks)
