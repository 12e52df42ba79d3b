"""The gateway's checked-in documents (`schemas/gateway/`: the A2A cards and the MCP tool
list of the example agents) are what it serves; `make schemas` regenerates them."""

from pathlib import Path

from tether.child.loading import load_agents
from tether.generate import gateway

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("examples.agents:Researcher", "examples.agents:Importer",
            "examples.agents:Summarizer")


def test_the_checked_in_gateway_documents_match_the_example_agents():
    assert gateway.differences(ROOT / "schemas" / "gateway",
                               gateway.generate(load_agents(EXAMPLES))) == []


def test_the_makefile_generates_them_for_the_agents_compose_serves():
    makefile = (ROOT / "Makefile").read_text()
    compose = (ROOT / "docker-compose.yml").read_text()
    assert f"GATEWAY_DOC_AGENTS = {','.join(EXAMPLES)}" in makefile
    assert f"TETHER_AGENTS: {','.join(EXAMPLES)}" in compose


def test_a_drifted_document_is_named(tmp_path):
    documents = gateway.generate(load_agents(EXAMPLES))
    gateway.write(tmp_path, documents)
    (tmp_path / "mcp-tools.json").write_text("{}\n")
    (tmp_path / "a2a" / "Gone.agent-card.json").write_text("{}\n")
    assert gateway.differences(tmp_path, documents) == [
        "not served by the gateway: a2a/Gone.agent-card.json", "differs: mcp-tools.json"]
