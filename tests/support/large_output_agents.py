"""A child whose result is as large as it is asked for, made of characters JSON escapes,
so that its stored `run.completed` event nears NATS's max payload and grows when it is
quoted again. Loaded by the services a test starts."""

from pydantic import BaseModel

from tether.child.agent import ChildAgent
from tether.child.context import RunContext


class SizeInput(BaseModel):
    # The result's length in characters: each is a quote or a backslash, which the
    # event's JSON writes as two bytes.
    characters: int


class LargeOutput(ChildAgent):
    description = "Returns a string of the length it is asked for, of quotes and backslashes"
    input_model = SizeInput

    async def run(self, ctx: RunContext, input: SizeInput) -> str:
        return large_output(input.characters)


def large_output(characters: int) -> str:
    return ('"\\' * (characters // 2 + 1))[:characters]
