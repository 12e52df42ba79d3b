"""The gateway's tests' stack: the parent service and a child-runner of the test agents in
the test's process, and a callers file of two callers."""

import asyncio
from collections.abc import AsyncIterator

import gateway_agents
import pytest
from gateway_stack import AGENTS, DESKTOP, LIMITED, running_gateway, sha

from tether.adapters.postgres.projector import Projector
from tether.agent_registry import AgentRegistry
from tether.log import get_logger
from tether_services.child_runner import open_runner
from tether_services.parent import open_parent


@pytest.fixture
def gateway_settings(settings, tmp_path):
    callers = tmp_path / "callers.toml"
    callers.write_text(f'''
[[caller]]
name = "desktop"
token_sha256 = "{sha(DESKTOP)}"

[[caller]]
name = "limited"
parent_agent = "Assistant"
token_sha256 = "{sha(LIMITED)}"
agents = ["Researcher"]
''')
    return settings.model_copy(update={
        "agents": tuple(f"gateway_agents:{cls.__name__}" for cls in AGENTS),
        "gateway_callers_file": str(callers), "work_ack_wait_ms": 1500})


@pytest.fixture
async def services(gateway_settings, log, pool, nc):
    """The parent service, a child-runner of the agents and the projector, in this
    process."""
    registry = AgentRegistry(AGENTS)
    runner = await open_runner(nc, gateway_settings, registry, fetch_timeout_s=0.3,
                               cancel_grace_s=0.2, shutdown_grace_s=0.2)
    parent = await open_parent(gateway_settings, log, pool, registry,
                               get_logger(service="parent-test"))
    projector = Projector(pool, log, gateway_settings.projection_schema,
                          leadership_check_s=0.1)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(runner.run(stop)), asyncio.create_task(parent.run(stop)),
             asyncio.create_task(projector.run(stop))]
    gateway_agents.RELEASE = asyncio.Event()  # of this test's loop
    yield
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)


@pytest.fixture
async def gateway(services, gateway_settings) -> AsyncIterator[str]:
    async with running_gateway(gateway_settings) as url:
        yield url
