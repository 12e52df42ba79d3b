"""A parent application delegating to child agents: the code behind `make demo`.

It fans out three researchers in parallel and waits for them, with their progress and
milestones drawn live from the parent's timeline; meanwhile a detached importer runs on
with a finish hook (handled right here) and a chat notification at its half-way
milestone. Copy it: everything below is the public client API.

    make demo                                  # servers, services and this script
    python examples/demo.py                    # against services you already run
                                               # (TETHER_NATS_URL, TETHER_PREFIX)
"""

import asyncio
import os
import sys
import uuid
from collections.abc import Mapping

from tether import LifecycleResult, RunInfo, connect
from tether.client import ParentHandle
from tether.client.render import Board, run_line

try:  # run as examples/demo.py, or imported as examples.demo
    from model_parent import main as converse
except ImportError:
    from examples.model_parent import main as converse

QUERIES = ("HTTP/3 and QUIC", "gRPC streaming", "WebTransport")
# The same research agent written with each framework (examples/integrations/).
FRAMEWORKS = {"PydanticResearcher": "Pydantic AI", "AgentsSdkResearcher": "OpenAI Agents SDK",
              "LangGraphResearcher": "LangGraph"}
IMPORT_INPUT = {"source": "s3://demo/customers.csv", "rows": 20_000, "batch": 1_000,
                "pace_s": 0.2}
DONE_WITHIN_S = 120


async def draw_progress(me: ParentHandle, board: Board) -> None:
    async for view in me.timeline():
        board.show([(run.run_id, run_line(run, width=board.bar_width))
                    for run in view.ordered()])


async def relay_chat(me: ParentHandle, board: Board, import_run: asyncio.Future) -> asyncio.Event:
    """Chat notifications the parent puts in this user's conversation."""
    noted = asyncio.Event()
    run_id = await import_run
    async for message in me.chat():
        board.say(f"  💬 chat ({message.role}): {message.content}")
        if message.metadata.get("run_id") == run_id:
            noted.set()
            return noted
    return noted


async def main() -> int:
    user = f"demo-{uuid.uuid4().hex[:6]}"
    with Board(sys.stdout) as board:
        await delegate(board, user)
    await frameworks(user)
    # The same children as the tools of a parent model (examples/model_parent.py).
    print()
    await converse()
    print(next_steps(user, os.environ))
    return 0


async def delegate(board: Board, user: str) -> None:
    async with connect(name="tether-demo") as tether:
        me = tether.parent("Assistant", user)
        finished: asyncio.Future[tuple[RunInfo, LifecycleResult]] = asyncio.Future()

        # A finish hook: the parent service calls it (through NATS) when a detached run
        # ends, in whichever process of this application is serving hooks.
        hooks = tether.hooks("Assistant")

        @hooks.on_finish("on_import_done")
        async def on_import_done(run: RunInfo, result: LifecycleResult) -> None:
            if run.parent.name == user and not finished.done():
                finished.set_result((run, result))

        board.say(f"Parent Assistant/{user}: three researchers, and an import in the "
                  "background.")

        async with hooks.running():
            progress = asyncio.create_task(draw_progress(me, board))
            import_run: asyncio.Future[str] = asyncio.Future()
            chat = asyncio.create_task(relay_chat(me, board, import_run))
            try:
                handle = await me.run_agent_tool(
                    "Importer", IMPORT_INPUT, display="customer import",
                    detached={"on_finish": "on_import_done", "on_milestones": ["half-imported"]})
                import_run.set_result(handle.run_id)
                board.say(f"Started the import in the background: run {handle.run_id}")

                results = await asyncio.gather(*(
                    me.run_agent_tool("Researcher", {"query": query, "pace_s": 0.7},
                                      display_order=order)
                    for order, query in enumerate(QUERIES)))
                for query, result in zip(QUERIES, results, strict=True):
                    text = result.summary if result.ok else f"failed: {result.error}"
                    board.say(f"  ✔ researcher on {query!r}: {text}")

                async with asyncio.timeout(DONE_WITHIN_S):
                    run, outcome = await finished
                    await chat
                board.say(f"  🪝 finish hook on_import_done: {run.agent_type} {run.run_id} "
                          f"{outcome.status}: {outcome.summary or outcome.error}")
            finally:
                for task in (progress, chat):
                    task.cancel()
                await asyncio.gather(progress, chat, return_exceptions=True)

async def frameworks(user: str) -> None:
    """The research agent of each framework, as children like any other: in parallel,
    each model call a recorded step, its usage the run's."""
    print("\nThe same research agent written with Pydantic AI, the OpenAI Agents SDK and "
          "LangGraph, as Tether children:")
    async with connect(name="tether-demo") as tether:
        me = tether.parent("Assistant", user)
        results = await asyncio.gather(*(
            me.run_agent_tool(agent_type, {"prompt": "HTTP/3"}, display=framework)
            for agent_type, framework in FRAMEWORKS.items()))
        for (agent_type, framework), result in zip(FRAMEWORKS.items(), results, strict=True):
            if not result.ok:
                print(f"  ✘ {agent_type} ({framework}): {result.error}")
                continue
            snapshot = await me.inspect(result.run_id)
            tokens = snapshot.usage.total_tokens if snapshot else 0
            print(f"  ✔ {agent_type} ({framework}): {result.summary} ({tokens} tokens)")


def next_steps(user: str, environ: Mapping[str, str]) -> str:
    """What to try next, as commands that work as printed, while the stack is still up."""
    if environ.get("TETHER_DEVSTACK_HELD") == "0":
        return ("\nDone. The services and servers stop now. To explore one that stays up: "
                "`eval \"$(make -s up)\"`, then `tether services all --agents "
                "examples.agents:Researcher,examples.agents:Importer,"
                "examples.model_parent:Planner,"
                "examples.integrations.pydantic_ai_research:PydanticResearcher,"
                "examples.integrations.openai_agents_research:AgentsSdkResearcher,"
                "examples.integrations.langgraph_research:LangGraphResearcher` and "
                "`python examples/demo.py`.")
    nats_url = environ.get("TETHER_NATS_URL", "nats://127.0.0.1:4222")
    lines = ["", "Done. Where to look next, in another terminal, from this directory:",
             f"  source .venv/bin/activate && export TETHER_NATS_URL={nats_url}"
             + (f" TETHER_PREFIX={environ['TETHER_PREFIX']}" if environ.get("TETHER_PREFIX")
                else ""),
             f"  tether watch Assistant/{user}",
             "      live progress bars of this parent's runs",
             f"  tether inspect Assistant/{user}",
             "      its runs, as JSON",
             f"  tether run Researcher --parent Assistant/{user} --input '{{\"query\": \"NATS\"}}'",
             "      one more run, from the command line",
             ("  TETHER_GATEWAY_CALLERS_FILE=examples/interop/callers.toml tether gateway "
              "--agents examples.agents:Researcher &"),
             "  python examples/interop/mcp_client.py --token demo-token 'HTTP/3'",
             "      the Researcher as an MCP tool, through the gateway (docs/interop.md)"]
    services = dict(item.split("=", 1) for item in
                    environ.get("TETHER_DEVSTACK_SERVICE_URLS", "").split(",") if "=" in item)
    for name, url in services.items():
        lines.append(f"  curl -s {url}/metrics    # {name}'s metrics")
    if environ.get("TETHER_DEVSTACK_HELD") == "1":
        lines.append("The stack stays up until you press Enter here.")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
