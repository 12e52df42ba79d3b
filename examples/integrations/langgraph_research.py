"""The research agent, written with LangGraph, as a durable Tether child.

    tether services child-runner --agents examples.integrations.langgraph_research:LangGraphResearcher
    tether run LangGraphResearcher --parent Assistant/me --input '{"prompt": "HTTP/3"}'

Its model is a script (LangChain's fake chat model; no API key needed): call a real chat
model in `call_model` (`langchain.chat_models.init_chat_model(...)`) for a real one.
"""

from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from tether.integrations.langgraph import child


class Scripted(GenericFakeChatModel):
    """Search first, then say what the sources say."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> "Scripted":
        return self


@tool
def search(query: str) -> str:
    """Search the web for a query."""
    return query


async def call_model(state: MessagesState) -> dict:
    last = state["messages"][-1]
    usage = {"input_tokens": 50, "output_tokens": 12, "total_tokens": 62}
    if last.type == "tool":
        reply = AIMessage(f"{last.content}: the two sources agree.", usage_metadata=usage)
    else:
        reply = AIMessage("", usage_metadata=usage, tool_calls=[{
            "name": "search", "args": {"query": last.content}, "id": "search-1",
            "type": "tool_call"}])
    return {"messages": [await Scripted(messages=iter([reply])).ainvoke(state["messages"])]}


graph = StateGraph(MessagesState)
graph.add_node("model", call_model)
graph.add_node("tools", ToolNode([search]))
graph.add_edge(START, "model")
graph.add_conditional_edges("model", tools_condition)
graph.add_edge("tools", "model")

LangGraphResearcher = child(graph.compile(), agent_type="LangGraphResearcher",
                            description="Researches a topic (LangGraph)")
