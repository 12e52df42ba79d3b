"""The gateway: Tether's child agents for callers outside Tether, over MCP (`mcp_tools`),
each caller a parent of its own (`callers`); `server` serves them (`tether gateway`)."""
