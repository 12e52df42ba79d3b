"""examples/integrations/, as their docstrings run them: the same research agent written
with Pydantic AI, the OpenAI Agents SDK and LangGraph, each a child of the services as
processes, run with `tether run`; each run's model calls are its recorded steps."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tether.domain.events import ParentRef

ROOT = Path(__file__).resolve().parents[2]
AGENTS = {"PydanticResearcher": "examples.integrations.pydantic_ai_research",
          "AgentsSdkResearcher": "examples.integrations.openai_agents_research",
          "LangGraphResearcher": "examples.integrations.langgraph_research"}


@pytest.fixture
async def running(services):
    env = {"TETHER_AGENTS": ",".join(f"{module}:{name}" for name, module in AGENTS.items())}
    await asyncio.gather(services("parent", **env), services("child-runner", **env))
    return env


@pytest.mark.parametrize("agent_type", sorted(AGENTS))
async def test_the_research_agent_of_each_framework_runs_as_a_child(
        running, agent_type, service_env, log):
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", "run", agent_type, "--parent", "Assistant/me",
        "--input", '{"prompt": "HTTP/3"}', "--run-id", "example", "--quiet", cwd=ROOT,
        env={**service_env, **running}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(run.communicate(), timeout=60)
    assert run.returncode == 0, (out.decode(), err.decode())
    result = json.loads(out)
    assert result["ok"] is True, result
    assert result["summary"] == "HTTP/3: the two sources agree.", result
    state = (await log.read_run(ParentRef(agent="Assistant", name="me"), "example")).state
    models = [step for step in state.steps.values() if step.get("kind") == "model"]
    assert len(models) == 2, state.steps
