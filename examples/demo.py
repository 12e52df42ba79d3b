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

from tether import LifecycleResult, RunInfo, connect
from tether.client import ParentHandle, TimelineView
from tether.client.render import run_line
from tether.log import configure_logging

QUERIES = ("HTTP/3 and QUIC", "gRPC streaming", "WebTransport")
IMPORT_INPUT = {"source": "s3://demo/customers.csv", "rows": 20_000, "batch": 1_000,
                "pace_s": 0.2}
DONE_WITHIN_S = 120


class Board:
    """Live run lines at the bottom of a terminal, with messages printed above them.

    Without a terminal (a pipe, CI) each changed line is printed once instead.
    """

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._lines: list[str] = []
        self._drawn = 0
        self._printed: dict[str, str] = {}

    def show(self, view: TimelineView) -> None:
        lines = [run_line(run, width=24) for run in view.ordered()]
        if self.tty:
            self._lines = lines
            self._redraw()
        else:
            for run_id in sorted(view.changed):
                line = run_line(view.runs[run_id], width=24) if run_id in view.runs else ""
                if line and self._printed.get(run_id) != line:
                    self._printed[run_id] = line
                    print(line, flush=True)

    def say(self, text: str) -> None:
        if self.tty:
            self._clear()
            print(text, flush=True)
            self._redraw()
        else:
            print(text, flush=True)

    def _clear(self) -> None:
        if self._drawn:
            print(f"\x1b[{self._drawn}F\x1b[J", end="", flush=True)
            self._drawn = 0

    def _redraw(self) -> None:
        self._clear()
        if self._lines:
            print("\n".join(self._lines), flush=True)
        self._drawn = len(self._lines)


async def draw_progress(me: ParentHandle, board: Board) -> None:
    async for view in me.timeline():
        board.show(view)


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
    configure_logging(level="warning")  # the library's own log lines would cut the board
    board = Board()
    user = f"demo-{uuid.uuid4().hex[:6]}"
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

        watch = f"tether watch Assistant/{user}"
        if os.environ.get("TETHER_NATS_URL"):
            watch = f"TETHER_NATS_URL={os.environ['TETHER_NATS_URL']} {watch}"
        print(f"Parent Assistant/{user}. In another terminal, follow it live:\n  {watch}\n")

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
                for query, result in zip(QUERIES, results):
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

    print(f"\nDone. Where to look next:\n"
          f"  {watch}\n      live progress bars of this parent's runs\n"
          f"  tether inspect Assistant/{user}\n      its runs as the projection has them\n"
          f"  tether run Researcher --parent Assistant/{user} --input '{{\"query\": \"NATS\"}}'\n"
          f"      one more run, from the command line\n"
          f"  curl -s 127.0.0.1:<health port>/metrics\n      a service's metrics "
          f"(ports in .tether/run-logs/*.log; README, \"Operating Tether\")")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(130)
