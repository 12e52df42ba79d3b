"""Child agents that think: agent definitions run by the child-runner.

    tether services child-runner --agents examples.model_agents:Researcher,examples.model_agents:Publisher

With no model configured they play their `script` (a scripted model client), so the demo
and the tests need no model. Point them at any OpenAI-compatible server instead with

    TETHER_MODEL_CLIENT=tether.agents.clients.openai_compatible:from_env
    TETHER_MODEL_BASE_URL=http://127.0.0.1:11434/v1   (and TETHER_MODEL_API_KEY if needed)

`python examples/model_agents.py` runs the Publisher in-process, pauses for approval,
approves, and prints the run's steps, usage and items.
"""

import asyncio
import json
import os
from typing import Any

from pydantic import BaseModel, Field

from tether.agents import (
    Agent,
    AgentDefinition,
    ModelAgent,
    ModelPrice,
    ModelRetry,
    PriceTable,
    Reply,
    ScriptedModelClient,
    ToolContext,
    tool,
)
from tether.agents.model_messages import ModelRequest

PRICES = PriceTable.of({"demo-small": ModelPrice(input_per_million=0.15, output_per_million=0.6,
                                                 cached_input_per_million=0.075)})


class SearchInput(BaseModel):
    query: str = Field(min_length=2, description="what to look for")


class PublishInput(BaseModel):
    title: str
    body: str


SOURCES = {"HTTP/3": ["RFC 9114: HTTP/3 maps HTTP semantics onto QUIC",
                      "QUIC (RFC 9000) runs over UDP with TLS 1.3 built in"]}


def _audit(line: str) -> None:
    """Where the demo's tools ran: one line per execution in $TETHER_EXAMPLE_TOOL_LOG."""
    if path := os.environ.get("TETHER_EXAMPLE_TOOL_LOG"):
        with open(path, "a", encoding="utf-8") as audit:
            audit.write(json.dumps({"tool": line, "pid": os.getpid()}) + "\n")


@tool
async def search(ctx: ToolContext, input: SearchInput) -> list[str]:
    """Search the web; returns the matching sources."""
    _audit(f"search:{input.query}")
    found = SOURCES.get(input.query, [f"nothing specific about {input.query}"])
    ctx.state.set("sources", [*ctx.state.get("sources", []), *found])
    await ctx.report_progress(milestone="sources-gathered", data={"sources": len(found)})
    return found


@tool(needs_approval=True)
async def publish(ctx: ToolContext, input: PublishInput) -> dict[str, Any]:
    """Publish a note for everyone to read; a human approves it first."""
    _audit(f"publish:{input.title}")
    return {"published": True, "url": f"https://notes.example/{ctx.run_id}"}


async def research_instructions(run: Any) -> str:
    audience = (run.context or {}).get("audience", "engineers")
    return f"You research technical topics for {audience}. Cite sources. Be brief."


def _summary(request: ModelRequest) -> Reply:
    sources = [m.content for m in request.messages if m.role == "tool"]
    return Reply(f"HTTP/3 runs over QUIC, which runs over UDP ({len(sources)} searches).",
                 chunk_delay_ms=20)


class Researcher(ModelAgent):
    """Searches twice, then answers; its answer streams like a real model's."""

    definition = AgentDefinition(
        id="researcher", model="demo-small", instructions=research_instructions,
        tools=(search,), max_steps=6, prices=PRICES,
        model_retries=ModelRetry(count=2, backoff_ms=200),
        description="Researches a topic with web searches and answers with sources")
    script = (
        Reply("Searching for sources.", [("search", {"query": "HTTP/3"})]),
        Reply("Checking the transport underneath.", [("search", {"query": "QUIC"})],
              chunk_delay_ms=100),
        _summary,
    )


def _after_review(request: ModelRequest) -> Reply:
    answer = request.messages[-1]
    if answer.is_error:
        return Reply(f"I did not publish the note. ({answer.content})")
    return Reply(f"Published: {json.loads(answer.content)['url']}")


class Publisher(ModelAgent):
    """Drafts a note and publishes it once a human approves the `publish` call."""

    definition = AgentDefinition(
        id="publisher", model="demo-small", instructions="Draft and publish short notes.",
        tools=(search, publish), max_steps=4, prices=PRICES,
        description="Writes a short note and publishes it after human approval")
    script = (
        Reply("Looking it up.", [("search", {"query": "HTTP/3"})]),
        Reply("Here is the note; publishing it needs your approval.",
              [("publish", {"title": "HTTP/3 in one line",
                            "body": "HTTP/3 is HTTP over QUIC, over UDP."})]),
        _after_review,
    )


async def main() -> None:
    agent = Agent(Publisher.definition, client=ScriptedModelClient(Publisher.script))
    paused = await agent.run("Write a note about HTTP/3 and publish it.")
    print(f"status: {paused.status}; waiting on "
          f"{[(p.tool_name, p.input['title']) for p in paused.pause.pending]}")
    done = await agent.continue_run(paused,
                                    approvals=[p.tool_call_id for p in paused.pause.pending])
    print(f"status: {done.status}; output: {done.output}")
    for step in done.steps:
        print(f"  step {step.index} ({step.kind}, call {step.call}): {step.text or '-'} "
              f"tools={[r.tool_name + ':' + r.decision for r in step.tool_results]}")
    print(f"usage: {done.usage.model_dump()}")
    for item in done.items:
        print(f"  {item.type:<13} {item.text or item.tool_name or ''}")


if __name__ == "__main__":
    asyncio.run(main())
