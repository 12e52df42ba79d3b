"""Remote agents as Tether children: an A2A agent (`a2a_agent`) or one tool of an MCP
server (`mcp_tool_agent`), each run of which is one remote task, recorded in the run's
log so that a runner that dies while it waits is replaced by one that picks the same task
up again (docs/interop.md). Needs the `remote` extra."""
