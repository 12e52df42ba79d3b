"""`make demo`'s command: the four services as processes and examples/demo.py."""

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("examples.agents:Researcher,examples.agents:Importer,examples.model_parent:Planner,"
          "examples.integrations.pydantic_ai_research:PydanticResearcher,"
          "examples.integrations.openai_agents_research:AgentsSdkResearcher,"
          "examples.integrations.langgraph_research:LangGraphResearcher")


async def test_the_demo_runs_every_kind_of_delegation_and_stops_what_it_started(
        log, pool, service_env):
    # `log` and `pool` remove the streams and the schema of this test's prefix afterwards.
    services = [arg for name in ("projector", "parent", "child-runner", "reconciler")
                for arg in ("--service", name)]
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "scripts" / "devstack.py"), "run", "--hold",
        "--agents", AGENTS,
        *services,
        "--", sys.executable, str(ROOT / "examples" / "demo.py"),
        cwd=ROOT, env=service_env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), timeout=90)
    text = output.decode()
    assert process.returncode == 0, text
    assert text.count("✔ researcher on") == 3, text
    assert "💬 chat (assistant): Importer" in text and "reached half-imported" in text
    assert "🪝 finish hook on_import_done: Importer" in text
    assert "completed: imported 20,000 rows" in text
    # The research agent of each framework, each run's usage its two model calls'.
    for agent_type, framework in (("PydanticResearcher", "Pydantic AI"),
                                  ("AgentsSdkResearcher", "OpenAI Agents SDK"),
                                  ("LangGraphResearcher", "LangGraph")):
        assert (f"✔ {agent_type} ({framework}): HTTP/3: the two sources agree. (124 tokens)"
                in text), text
    # The model parent: two Researchers in one turn, a detached Importer, and the answer
    # the model gives to the importer's completion message.
    planner = text[text.index("Conversation Planner/"):]
    assert planner.count("Researcher completed") == 2, planner
    assert "Importer completed (detached)" in planner
    assert "📬 notify: Background task Importer" in planner
    assert "🤖 planner: The customer import is done (imported 20,000 rows" in planner
    # Not on a terminal the stack is not held: no hints at servers about to stop.
    assert "Done. The services and servers stop now." in text
    assert "Where to look next" not in text and "tether watch" not in text
    for name in ("projector", "parent", "child-runner", "reconciler"):
        assert f"tether services {name} (pid " in text and "health and metrics at http://" in text
    for name in ("projector", "parent", "child-runner", "reconciler"):
        assert f"tether services {name} stopped (exit 0)" in text, text
