"""The gateway: Tether's child agents for callers outside Tether, each caller a parent of
its own (`callers`): as MCP tools (`mcp_tools`) and as A2A agents (`a2a_agents`, their
tasks in `a2a_tasks`); `server` serves them (`tether gateway`)."""
