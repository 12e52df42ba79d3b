"""A tree of model agents for the UI's browser tests: a Chief delegates to a Lead, which
delegates to a Clerk, whose `sign` call waits for a human. Scripted, so no model is
needed; the services import this module from tests/support (PYTHONPATH)."""

from pydantic import BaseModel

from tether import agent_tool
from tether.agents import AgentDefinition, ModelAgent, ModelAgentInput, Reply, ToolContext, tool


class Paper(BaseModel):
    title: str


@tool(needs_approval=True)
async def sign(ctx: ToolContext, input: Paper) -> str:
    """Sign a paper (a human approves first)."""
    return f"signed {input.title}"


class Clerk(ModelAgent):
    definition = AgentDefinition(id="clerk", model="scripted", tools=(sign,))
    script = (Reply("Signing.", [("sign", {"title": "lease"})]), Reply("Signed the lease."))


class Lead(ModelAgent):
    definition = AgentDefinition(
        id="lead", model="scripted",
        tools=(agent_tool(Clerk, description="Get papers signed.", input_model=ModelAgentInput),))
    script = (Reply("", [("Clerk", {"input": "sign the lease"})]), Reply("The clerk signed."))


class Chief(ModelAgent):
    definition = AgentDefinition(
        id="chief", model="scripted",
        tools=(agent_tool(Lead, description="Delegate to the lead.", input_model=ModelAgentInput),))
    script = (Reply("", [("Lead", {"input": "handle the lease"})]), Reply("All done."))
