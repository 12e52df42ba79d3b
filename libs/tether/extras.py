"""Tether's optional parts and what they need: `pip install 'tether[ui]'` and so on.

The runtime, the CLI and the services need none of them. A module that needs one imports
it at its top and, when it is missing, raises `MissingExtra`; a command that needs one
asks `require` before it starts anything. Either way the user reads one line naming the
extra and the command that installs it.
"""

import importlib.util

# extra: the modules it brings, and what needs it
EXTRAS = {
    "ui": (("starlette", "uvicorn"), "the web timeline (`tether ui`, the `ui` service)"),
    "openai": (("httpx",), "the OpenAI-compatible model client"),
    "otel": (("opentelemetry.sdk",), "OpenTelemetry traces"),
    "gateway": (("mcp", "a2a", "starlette", "uvicorn"),
                "the MCP and A2A gateway (`tether gateway`, the `gateway` service)"),
    "pydantic-ai": (("pydantic_ai",),
                    "Pydantic AI agents as children (tether.integrations.pydantic_ai)"),
    "openai-agents": (("agents",),
                      "Agents SDK agents as children (tether.integrations.openai_agents)"),
    "langgraph": (("langgraph", "langchain_core"),
                  "LangGraph graphs as children (tether.integrations.langgraph)"),
    "remote": (("mcp", "a2a", "httpx"),
               "remote A2A agents and MCP tools as child agents (tether.remote)"),
}


class MissingExtra(ImportError):
    """An optional part was asked for without its extra installed.

    An ImportError, so that what loads a module by name (`TETHER_MODEL_CLIENT`) reports it
    as it reports any module that cannot be imported, with this message.
    """

    def __init__(self, extra: str) -> None:
        super().__init__(f"{EXTRAS[extra][1]} needs the {extra!r} extra: "
                         f"pip install 'tether[{extra}]'")
        self.extra = extra


def installed(extra: str) -> bool:
    modules, _ = EXTRAS[extra]
    try:
        return all(importlib.util.find_spec(module) is not None for module in modules)
    except ModuleNotFoundError:  # a dotted name's parent package is missing
        return False


def require(extra: str) -> None:
    if not installed(extra):
        raise MissingExtra(extra)
