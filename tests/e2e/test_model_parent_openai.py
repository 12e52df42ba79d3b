"""examples/model_parent.py on its OpenAI-compatible path: the child-runner's Planner asks
a chat-completions server over HTTP (TETHER_MODEL_BASE_URL) instead of its script.

The server is a local stand-in that speaks the wire format (streamed text, tool calls
in pieces, usage) and decides from the conversation each request carries; the parent
and the child-runner run as processes, and the example runs as a script.
"""

import asyncio
import json
import sys
from pathlib import Path

from chat_completions import Answer, ChatCompletionsServer

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "examples.agents:Researcher,examples.agents:Importer,examples.model_parent:Planner"
IMPORT = {"source": "s3://demo/customers.csv", "rows": 400, "batch": 100}


def decide(body: dict) -> Answer:
    """What a model would answer: fan out and start the import, then sum up the research,
    then answer the importer's completion message."""
    messages = body["messages"]
    last = messages[-1]
    if last["role"] == "tool":
        found = [m["content"] for m in messages if m["role"] == "tool"]
        return Answer(f"Research done: {found[0][:40]} | {found[1][:40]}. Importing meanwhile.")
    if last["role"] == "user" and "Importer" in last["content"]:
        return Answer(f"The import is done: {last['content']}")
    return Answer("Researching both and starting the import.", (
        ("call_r1", "Researcher", {"query": "HTTP/3 for public APIs"}),
        ("call_r2", "Researcher", {"query": "gRPC for internal services"}),
        ("call_i1", "Importer", IMPORT)))


async def test_the_model_parent_example_runs_against_an_openai_compatible_server(
        log, services, service_env):
    async with ChatCompletionsServer(decide) as model:
        model_env = {"TETHER_AGENTS": AGENTS, "TETHER_MODEL_BASE_URL": model.url,
                     "TETHER_MODEL_API_KEY": "sk-local-test", "TETHER_MODEL_NAME": "fake-model"}
        await services("parent", TETHER_AGENTS=AGENTS)
        await services("child-runner", **model_env)
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "examples" / "model_parent.py"), cwd=ROOT,
            env={**service_env, **model_env}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=90)
    text = output.decode()
    assert process.returncode == 0, text

    # Three model calls: the fan-out, the research summary, the answer to the notice.
    assert len(model.requests) == 3, text
    first, second, third = model.requests
    assert all(h["authorization"] == "Bearer sk-local-test" for h in model.headers)
    assert all(r["model"] == "fake-model" and r["stream"] is True for r in model.requests)
    assert first["messages"][0]["role"] == "system"
    assert first["messages"][-1] == {"role": "user", "content":
                                     "Compare HTTP/3 and gRPC for our API, and import the "
                                     "customer list meanwhile."}
    tools = {t["function"]["name"]: t["function"] for t in first["tools"]}
    assert set(tools) == {"Researcher", "Importer"}
    assert "query" in tools["Researcher"]["parameters"]["properties"]
    assert tools["Importer"]["parameters"]["required"] == ["source"]
    # The model's own call ids name the runs, and each result went back under its id.
    results = {m["tool_call_id"]: m["content"] for m in second["messages"] if m["role"] == "tool"}
    assert set(results) == {"call_r1", "call_r2", "call_i1"}
    assert "HTTP/3" in results["call_r1"] and "gRPC" in results["call_r2"]
    handle = json.loads(results["call_i1"])
    assert (handle["run_id"], handle["status"]) == ("agent-tool:call_i1", "running")
    [assistant] = [m for m in second["messages"] if m.get("tool_calls")]
    assert [json.loads(c["function"]["arguments"]) for c in assistant["tool_calls"]][2] == IMPORT
    notice = third["messages"][-1]
    assert notice["role"] == "user" and "Importer" in notice["content"]
    assert "imported 400 rows" in notice["content"]

    # What the example printed: the streamed answer to the notice, and the runs.
    assert f"🤖 planner: The import is done: {notice['content']}" in text
    assert "agent-tool:call_r1 Researcher completed" in text
    assert "agent-tool:call_r2 Researcher completed" in text
    assert "agent-tool:call_i1 Importer completed (detached)" in text
