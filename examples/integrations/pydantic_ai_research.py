"""The research agent, written with Pydantic AI, as a durable Tether child.

    tether services child-runner --agents examples.integrations.pydantic_ai_research:PydanticResearcher
    tether run PydanticResearcher --parent Assistant/me --input '{"prompt": "HTTP/3"}'

Its model is a script (no API key needed); set PYDANTIC_AI_MODEL (e.g.
`openai:gpt-4o-mini`, with the provider's key in the environment) for a real one.
"""

import os

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from tether.integrations.pydantic_ai import child


def scripted(messages, info: AgentInfo) -> ModelResponse:
    """Search first, then say what the sources say."""
    last = messages[-1].parts[-1]
    usage = RequestUsage(input_tokens=50, output_tokens=12)
    if isinstance(last, ToolReturnPart):
        return ModelResponse(parts=[TextPart(f"{last.content}: the two sources agree.")],
                             usage=usage)
    return ModelResponse(parts=[ToolCallPart("search", {"query": last.content})], usage=usage)


research = Agent(os.environ.get("PYDANTIC_AI_MODEL") or FunctionModel(scripted),
                 name="PydanticResearcher",
                 instructions="Search for the question, then answer in one sentence.")


@research.tool_plain
def search(query: str) -> str:
    """Search the web for a query."""
    return query


PydanticResearcher = child(research, description="Researches a topic (Pydantic AI)")
