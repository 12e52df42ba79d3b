"""Remote agents as Tether children: the Researcher that a Tether gateway serves, used back
through each protocol as a child of this Tether (any A2A agent or MCP server would do).

    # NATS and Postgres up (make up); the parent and a child-runner that know them:
    export GATEWAY_TOKEN=demo-token
    export TETHER_AGENTS=examples.agents:Researcher,examples.interop.remote_children:RemoteResearcher,examples.interop.remote_children:ResearchTool
    tether services parent & tether services child-runner &
    TETHER_GATEWAY_CALLERS_FILE=examples/interop/callers.toml \
        tether gateway --agents examples.agents:Researcher &
    tether run RemoteResearcher --parent Assistant/me --input '{"query": "HTTP/3"}'
    tether run ResearchTool --parent Assistant/me --input '{"query": "HTTP/3"}'

Each run is one remote task, recorded in its log: stop the child-runner while it waits
and start it again, and the run follows the same remote task to its end.
"""

import os

from pydantic import BaseModel

from tether.remote.a2a_agent import a2a_agent
from tether.remote.mcp_tool import mcp_tool_agent

GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8092")


class Query(BaseModel):
    query: str


RemoteResearcher = a2a_agent(
    "RemoteResearcher", f"{GATEWAY}/a2a/Researcher", token_variable="GATEWAY_TOKEN",
    description="The gateway's Researcher, over A2A", input_model=Query)

ResearchTool = mcp_tool_agent(
    "ResearchTool", f"{GATEWAY}/mcp", "Researcher", token_variable="GATEWAY_TOKEN",
    description="The gateway's Researcher tool, over MCP", input_model=Query)
