"""A child's own agent tools get run ids derived from its run and the call."""

from typing import Any

from tether.child.context import RunContext
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier


class RecordingClient:
    def __init__(self) -> None:
        self.run_ids: list[str] = []

    async def run_agent_tool(self, agent_type: str, input: dict[str, Any], **options: Any):
        self.run_ids.append(options["run_id"])
        return options["run_id"]


def attempt(run_id: str, number: int) -> tuple[RunContext, RecordingClient]:
    client = RecordingClient()
    ctx = RunContext(run_id=run_id, parent=ParentRef(agent="Assistant", name="user-1"),
                     agent_type="Coordinator", attempt=number, recorder=None, client=client)
    return ctx, client


async def calls(ctx: RunContext, *parts: str) -> None:
    for part in parts:
        await ctx.run_agent_tool("Summarizer", {"text": part})


async def test_a_resumed_child_calls_the_same_grandchild_runs() -> None:
    first, before = attempt("coordinate-1", 1)
    await calls(first, "one", "two", "one")
    resumed, after = attempt("coordinate-1", 2)
    await calls(resumed, "one", "two", "one")

    assert after.run_ids == before.run_ids
    assert len(set(before.run_ids)) == 3, "two alike calls are two runs"
    for run_id in before.run_ids:
        assert run_id.startswith("coordinate-1:") and check_identifier(run_id)


async def test_a_resumed_child_that_skips_a_call_gets_the_ids_of_the_calls_it_makes() -> None:
    first, before = attempt("coordinate-1", 1)
    await calls(first, "one", "two")
    resumed, after = attempt("coordinate-1", 2)
    await calls(resumed, "two")  # "one" was recorded as a step and is not called again
    assert after.run_ids == before.run_ids[1:]


async def test_another_run_or_another_input_is_another_grandchild() -> None:
    a, in_a = attempt("coordinate-1", 1)
    b, in_b = attempt("coordinate-2", 1)
    await calls(a, "one")
    await calls(b, "one")
    await a.run_agent_tool("Summarizer", {"text": "other"})
    assert len({*in_a.run_ids, *in_b.run_ids}) == 3


async def test_a_long_run_id_still_gives_a_valid_one_and_an_explicit_id_is_kept() -> None:
    ctx, client = attempt("r" * 128, 1)
    await calls(ctx, "one")
    await ctx.run_agent_tool("Summarizer", {"text": "x"}, run_id="chosen")
    assert check_identifier(client.run_ids[0]) and len(client.run_ids[0]) <= 128
    assert client.run_ids[1] == "chosen"
