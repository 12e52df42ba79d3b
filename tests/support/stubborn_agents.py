"""A child that does not look at `ctx.cancelled`: only the runner's hard stop, after the
cancel grace, ends it early. Loaded by the services a test starts (PYTHONPATH).

With `STUBBORN_TURNS` set to a file, each turn's start is appended to it as a JSON line
(run id, attempt, process id, wall time), so a test can tell which process started a
child turn and when."""

import asyncio
import json
import os
import time

from pydantic import BaseModel

from tether.child.agent import ChildAgent
from tether.child.context import RunContext


class StubbornInput(BaseModel):
    seconds: float


class Stubborn(ChildAgent):
    description = "Works for a while, deaf to a cooperative cancel"
    input_model = StubbornInput

    async def run(self, ctx: RunContext, input: StubbornInput) -> str:
        if turns := os.environ.get("STUBBORN_TURNS"):
            _record_turn(turns, {"run_id": ctx.run_id, "attempt": ctx.attempt,
                                 "pid": os.getpid(), "at": time.time()})
        await asyncio.sleep(input.seconds)
        return f"worked {input.seconds:g}s"


def _record_turn(path: str, turn: dict) -> None:
    with open(path, "a") as file:  # a line at a time: never a partial one for the reader
        file.write(json.dumps(turn) + "\n")


class Narrator(ChildAgent):
    """A parent class that words its runs' chat notices itself (as a model parent does)."""

    description = "A parent whose notices are its own"

    async def run(self, ctx: RunContext, input: StubbornInput) -> str:
        return "nothing to do"

    def format_detached_completion(self, run, result) -> str:
        return f"Narrator heard: {run.run_id} ended {result.status}"


class Blocker(ChildAgent):
    """Calls blocking code on the event loop, as a child must not: `time.sleep`."""

    description = "Blocks its runner's event loop for a while"
    input_model = StubbornInput

    async def run(self, ctx: RunContext, input: StubbornInput) -> str:
        time.sleep(input.seconds)  # noqa: ASYNC251 - BLOCKS: the line the runner's warning names
        return f"blocked {input.seconds:g}s"
