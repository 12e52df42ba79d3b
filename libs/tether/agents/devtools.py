"""A run's steps, tool calls, usage and timings, as `tether runs show RUN_ID --parent
Agent/name` prints them (`tether.client.branch_commands`).

Read from the projections (the `runs` table's `state`, the folded run with its recorded
steps), so it works for any run the projector has seen, finished or not, without
touching NATS.
"""

import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import asyncpg
import msgspec

from tether.adapters.postgres.reads import ProjectionReads
from tether.agents.steps import AgentStepRecord
from tether.config import Settings
from tether.contract.messages import UsageView
from tether.domain import spending
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState, SteeringMessage, state_json
from tether.domain.steering_transitions import message_standing

PREVIEW_CHARS = 120


async def load_run(settings: Settings, parent: ParentRef, run_id: str) -> RunState | None:
    state, _ = await load_tree(settings, parent, run_id)
    return state


async def load_tree(settings: Settings, parent: ParentRef,
                    run_id: str) -> tuple[RunState | None, list[RunState]]:
    """A run and every run below it, from the projections."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        projections = ProjectionReads(conn, settings.projection_schema)
        state = await projections.run(parent, run_id)
        return state, [] if state is None else await projections.below(state)
    finally:
        await conn.close()


async def show_run(settings: Settings, parent: ParentRef, run_id: str, *, as_json: bool = False,
                   out: TextIO | None = None) -> int:
    out = out or sys.stdout
    state, below = await load_tree(settings, parent, run_id)
    if state is None:
        print(f"tether: no run {run_id!r} of {parent.agent}/{parent.name} in the projections "
              f"(schema {settings.projection_schema})", file=sys.stderr)
        return 1
    print(msgspec.json.format(state_json(state), indent=2).decode() if as_json else render_run(state, below), file=out)
    return 0


def _usage_line(label: str, usage: UsageView) -> str:
    cost = "unknown" if usage.cost is None else f"${usage.cost:.6f}"
    return (f"{label:<10}in {usage.input_tokens:,}  out {usage.output_tokens:,}  "
            f"cached {usage.cached_tokens:,}  total {usage.total_tokens:,}  cost {cost}")


def render_run(state: RunState, below: list[RunState] | None = None) -> str:
    records = records_of(state)
    parent = f"{state.parent.agent}/{state.parent.name}"
    timings = (f"requested {_clock(state.requested_at)}"
               f"  started {_after(state.requested_at, state.started_at)}"
               f"  ended {_after(state.requested_at, state.ended_at)}")
    lines = [f"run {state.run_id}  {state.agent_type}  parent {parent}"]
    for turn in state.turns:
        said = turn.summary if turn.status == "completed" else turn.error
        lines.append(f"turn {turn.turn:<4} {turn.status}  {compact(turn.input)}  "
                     f"{turn.tokens:,} tokens  -> {preview(said or '')}")
    lines += [f"status    {_status(state)}  attempt {state.attempt}"
              + (f"  turn {state.turn}" if state.turn > 1 else "")
              + (f"  version {state.agent_version}" if state.agent_version else ""),
              f"timings   {timings}"]
    if not state.steps:
        lines.append("steps     none recorded (a child that records no steps, or not started)")
    inputs = {call.id: call.input for record in records for call in record.tool_calls}
    for record in records:
        lines += _step(record, inputs, state.requested_at)
    for index, step in other_steps(state):
        lines.append(f"step {index:<4} {step.get('kind', 'step')}  {compact(step)}")
    if any(step.get("turn") for step in state.steps.values()):
        lines.append(_usage_line("usage", UsageView.of_steps(state.steps)))
    if below:
        subtree = UsageView.of_steps(state.steps)
        for run in below:
            subtree = subtree.plus(UsageView.of_steps(run.steps))
        lines.append(_usage_line("subtree", subtree)
                     + f"  ({len(below)} run{'s' if len(below) != 1 else ''} below)")
    lines += _budget_lines(state)
    for resumption in state.resumptions:
        lines.append(f"continue  {_clock(resumption.at)}  {compact(resumption.decisions)}")
    for message in state.messages:
        stage = (f"taken in {_after(state.requested_at, message.consumed_at)}"
                 if message.consumed_at is not None else
                 f"delivered {_after(state.requested_at, message.delivered_at)}"
                 if message.delivered_at is not None else
                 "waiting" if state.is_open else "never handed over")
        stage += _turns_of(state, message)
        said = message.text if message.text is not None else compact(message.data)
        lines.append(f"message   {message.message_id} [{message.mode}] "
                     f"sent {_after(state.requested_at, message.sent_at)}, {stage}  "
                     f"{preview(said)}")
    if state.summary:
        lines.append(f"summary   {preview(state.summary)}")
    if state.error:
        lines.append(f"error     {state.error}")
    return "\n".join(lines)


def _turns_of(state: RunState, message: SteeringMessage) -> str:
    """Where a message stands across turns, when a turn ended without taking it in."""
    standing = message_standing(state, message)
    if standing == "unread":
        return f", unread: turn {state.turn} ended without it"
    if standing == "carried":
        taken = (f"taken in by turn {message.consumed_in_turn}"
                 if message.consumed_in_turn is not None else f"waiting in turn {state.turn}")
        return f", carried from turn {message.sent_in_turn}: {taken}"
    return ""


def _budget_lines(state: RunState) -> list[str]:
    """Its budget in tokens and cost over it and the runs below it: spent, reserved by
    open runs below it, left."""
    used, held = spending.spent(state), spending.reserved(state)
    tokens, cost = spending.left(state)
    lines = []
    if state.max_tokens is not None and tokens is not None:
        lines.append(f"budget    {used.tokens:,} of {state.max_tokens:,} tokens spent, "
                     f"{held.tokens:,} reserved, {tokens:,} left")
    if state.max_cost is not None and cost is not None:
        lines.append(f"budget    ${used.cost:.6f} of ${state.max_cost:.6f} spent, "
                     f"${held.cost:.6f} reserved, ${cost:.6f} left")
    return lines


def _status(state: RunState) -> str:
    if state.paused is not None:
        return f"{state.status}, {state.paused.reason} ({len(state.paused.pending)} pending)"
    if state.reason:
        return f"{state.status} ({state.reason})"
    return state.status


def _step(record: AgentStepRecord, inputs: dict[str, dict[str, Any]], origin: int) -> list[str]:
    duration = f"{_after(origin, record.started_at)}, {record.ended_at - record.started_at:,} ms"
    head = f"#{record.index:<3}"
    if record.turn is None:
        lines = [f"{head} continuation  call {record.call}  {duration}  -> {record.status}"]
    else:
        turn, usage = record.turn, record.turn.usage
        cost = "" if record.cost is None else f"  ${record.cost:.6f}"
        attempts = f"{turn.attempts} attempt{'s' if turn.attempts != 1 else ''}"
        lines = [(f"{head} model turn  call {record.call}  {record.model}  {duration} "
                  f"(model {turn.duration_ms:,} ms, {attempts})  finish {turn.finish_reason}  "
                  f"-> {record.status}"),
                 (f"      tokens in {usage.input_tokens:,} out {usage.output_tokens:,} "
                  f"cached {usage.cached_tokens:,}{cost}  request {turn.request_id}")]
        if turn.message.content:
            lines.append(f"      text  {preview(turn.message.content)}")
    for result in record.tool_results:
        flag = " ERROR" if result.is_error else ""
        called = compact(inputs.get(result.tool_call_id, {}))
        lines.append(f"      tool  {result.tool_name} [{result.decision}]{flag} {called}  "
                     f"{result.duration_ms:,} ms  -> {preview(result.content)}")
    for pending in record.pending:
        lines.append(f"      wait  {pending.tool_name} {compact(pending.input)}  "
                     f"({pending.reason}, id {pending.tool_call_id})")
    if record.human_input:
        lines.append(f"      human {preview(record.human_input)}")
    if record.note:
        lines.append(f"      note  {preview(record.note)}")
    if record.inbox:
        lines.append(f"      took  {', '.join(record.inbox)}")
    for message in record.steering:
        lines.append(f"      told  [{message.mode}] {preview(message.content)}  "
                     f"(message {message.message_id})")
    if record.stop_reason:
        lines.append(f"      stop  {record.stop_reason}")
    return lines


def _clock(epoch_ms: int) -> str:
    moment = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"


def _after(origin: int, moment: int | None) -> str:
    return "—" if moment is None else f"+{moment - origin:,} ms"


def compact(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """`value` as JSON on one line, cut to `limit` characters."""
    return preview(json.dumps(value, ensure_ascii=False, separators=(",", ":")), limit)


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """`text` on one line, cut to `limit` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


# The kinds of the steps a model agent records (`AgentStepRecord`); a child of another
# kind records steps of its own shape (a remote task, a framework's model call).
AGENT_STEP_KINDS = frozenset({"model_turn", "continuation"})


def records_of(state: RunState) -> Sequence[AgentStepRecord]:
    """The run's model-agent step records, in order."""
    return [AgentStepRecord.model_validate(state.steps[i]) for i in sorted(state.steps)
            if state.steps[i].get("kind") in AGENT_STEP_KINDS]


def other_steps(state: RunState) -> list[tuple[int, dict[str, Any]]]:
    """The run's steps of other shapes, in order, as the child recorded them."""
    return [(i, state.steps[i]) for i in sorted(state.steps)
            if state.steps[i].get("kind") not in AGENT_STEP_KINDS]
