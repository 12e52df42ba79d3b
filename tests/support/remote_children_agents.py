"""A remote A2A agent and an MCP server's tool as children, for services a test starts as
processes (PYTHONPATH): their URLs and token from the environment the test gives them."""

import os

from tether.remote.a2a_agent import a2a_agent
from tether.remote.mcp_tool import mcp_tool_agent

Echo = a2a_agent("Echo", os.environ.get("REMOTE_A2A_URL", "http://127.0.0.1:1"),
                 token_variable="ECHO_TOKEN", unreachable_for_s=30)

Counter = mcp_tool_agent("Counter", os.environ.get("REMOTE_MCP_URL", "http://127.0.0.1:1/mcp"),
                         "count", token_variable="ECHO_TOKEN", unreachable_for_s=30)
