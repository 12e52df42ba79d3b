"""The demo's closing hints: commands that work as printed, for a stack still up."""

from examples.demo import next_steps


def test_a_held_stack_gets_commands_with_its_url_and_every_metrics_endpoint() -> None:
    text = next_steps("demo-abc123", {
        "TETHER_DEVSTACK_HELD": "1", "TETHER_NATS_URL": "nats://127.0.0.1:40001",
        "TETHER_DEVSTACK_SERVICE_URLS": "parent=http://127.0.0.1:5001,projector=http://127.0.0.1:5002"})
    assert text.splitlines()[1:] == [
        "Done. Where to look next, in another terminal, from this directory:",
        "  source .venv/bin/activate && export TETHER_NATS_URL=nats://127.0.0.1:40001",
        "  tether watch Assistant/demo-abc123",
        "      live progress bars of this parent's runs",
        "  tether inspect Assistant/demo-abc123",
        "      its runs, as JSON",
        "  tether run Researcher --parent Assistant/demo-abc123 --input '{\"query\": \"NATS\"}'",
        "      one more run, from the command line",
        ("  TETHER_GATEWAY_CALLERS_FILE=examples/interop/callers.toml tether gateway "
         "--agents examples.agents:Researcher &"),
        "  python examples/interop/mcp_client.py --token demo-token 'HTTP/3'",
        "      the Researcher as an MCP tool, through the gateway (docs/interop.md)",
        "  curl -s http://127.0.0.1:5001/metrics    # parent's metrics",
        "  curl -s http://127.0.0.1:5002/metrics    # projector's metrics",
        "The stack stays up until you press Enter here.",
    ]


def test_a_stack_about_to_stop_gets_no_commands_for_it() -> None:
    text = next_steps("demo-abc123", {"TETHER_DEVSTACK_HELD": "0",
                                      "TETHER_NATS_URL": "nats://127.0.0.1:40001"})
    assert "tether watch" not in text and "40001" not in text
    assert text.startswith("\nDone. The services and servers stop now.")


def test_services_run_by_hand_get_the_prefix_too() -> None:
    text = next_steps("demo-1", {"TETHER_NATS_URL": "nats://h:4222", "TETHER_PREFIX": "mine"})
    assert "export TETHER_NATS_URL=nats://h:4222 TETHER_PREFIX=mine" in text
