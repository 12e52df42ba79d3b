"""The research agent, written with the OpenAI Agents SDK, as a durable Tether child.

    tether services child-runner --agents examples.integrations.openai_agents_research:AgentsSdkResearcher
    tether run AgentsSdkResearcher --parent Assistant/me --input '{"prompt": "HTTP/3"}'

Its model is a script (no API key needed); set AGENTS_SDK_MODEL (e.g. `gpt-4o-mini`,
with OPENAI_API_KEY) for a real one.
"""

import json
import os
from typing import Any

from agents import Agent, Model, ModelResponse, Usage, function_tool
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from tether.integrations.openai_agents import child


class Scripted(Model):
    """Search first, then say what the sources say."""

    async def get_response(self, system_instructions, input, *args: Any,
                           **kwargs: Any) -> ModelResponse:
        results = [item["output"] for item in input
                   if isinstance(item, dict) and item.get("type") == "function_call_output"]
        if results:
            output: list[Any] = [ResponseOutputMessage(
                type="message", id="msg-1", role="assistant", status="completed",
                content=[ResponseOutputText(type="output_text", annotations=[],
                                            text=f"{results[-1]}: the two sources agree.")])]
        else:
            question = input[-1]["content"] if isinstance(input, list) else input
            output = [ResponseFunctionToolCall(
                type="function_call", id="fc-1", call_id="search-1", name="search",
                arguments=json.dumps({"query": question}), status="completed")]
        return ModelResponse(output=output, response_id=None, usage=Usage(
            requests=1, input_tokens=50, output_tokens=12, total_tokens=62))

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
def search(query: str) -> str:
    """Search the web for a query."""
    return query


research = Agent(name="AgentsSdkResearcher", tools=[search],
                 instructions="Search for the question, then answer in one sentence.",
                 model=os.environ.get("AGENTS_SDK_MODEL") or Scripted())

AgentsSdkResearcher = child(research, description="Researches a topic (OpenAI Agents SDK)")
