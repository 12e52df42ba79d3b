"""The gateway's documents for a set of agent types, as it serves them: each agent's A2A
card (`a2a/<agent type>.agent-card.json`) and the MCP tool list (`mcp-tools.json`).

    python -m tether.generate.gateway --agents module:Class[,...] --write   # or --check

`make schemas` writes those of the example agents (the ones the compose stack and the
Kubernetes manifests serve) under `schemas/gateway/`, at the compose stack's address;
`--check` exits non-zero when the files there differ from what the gateway would serve.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import mcp_types as types
from a2a.server.request_handlers.response_helpers import agent_card_to_dict

from tether.agent_registry import AgentRegistry
from tether.child.loading import load_agents
from tether.gateway.a2a_agents import agent_card
from tether.gateway.mcp_tools import tool_of
from tether.generate import documents

DEFAULT_BASE_URL = "http://127.0.0.1:8092"


def generate(agents: AgentRegistry, base_url: str = DEFAULT_BASE_URL) -> dict[str, Any]:
    """Relative file path -> document."""
    documents: dict[str, Any] = {
        f"a2a/{agent_type}.agent-card.json": agent_card_to_dict(
            agent_card(agent_type, agents.get(agent_type), base_url))
        for agent_type in agents.agent_types}
    tools = types.ListToolsResult(tools=[tool_of(agent_type, agents.get(agent_type))
                                         for agent_type in agents.agent_types])
    documents["mcp-tools.json"] = tools.model_dump(by_alias=True, mode="json",
                                                   exclude_none=True)
    return documents


def differences(directory: Path, generated: dict[str, Any]) -> list[str]:
    return documents.differences(directory, generated, directory.rglob("*.json"),
                                 unknown="not served by the gateway")


def write(directory: Path, generated: dict[str, Any]) -> None:
    documents.write(directory, generated, list(directory.rglob("*.json")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tether.generate.gateway")
    parser.add_argument("--agents", required=True, help="module:Class[,module:Class]")
    parser.add_argument("--dir", type=Path, default=Path("schemas/gateway"))
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help=f"where callers reach the gateway (default {DEFAULT_BASE_URL})")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate the files")
    action.add_argument("--check", action="store_true", help="fail when the files drift")
    args = parser.parse_args(argv)
    generated = generate(load_agents(tuple(args.agents.split(","))), args.base_url)
    if args.write:
        write(args.dir, generated)
        print(f"wrote {len(generated)} gateway documents under {args.dir}/")
        return 0
    return documents.report(differences(args.dir, generated))


if __name__ == "__main__":
    sys.exit(main())
