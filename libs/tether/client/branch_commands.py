"""`tether runs`: a run's recorded steps (`show`), and its branches: `fork` (a new run from
a step of it, beside it), `rewind` (a failed run taken up again from its last step) and
`diff` (two runs side by side, from where they part).

`show` and `diff` read the projections (Postgres) only; `fork` and `rewind` ask the
parent over NATS, as the parent whose runs they are, and print the outcome as JSON.
Exit codes as the other client commands: 0 success, 1 a failed or refused run or an
unknown run, 2 bad arguments.
"""

import argparse
import asyncio
import json
import sys
from typing import Any, TextIO

import asyncpg

from tether.agents.devtools import compact, load_run, preview, show_run
from tether.client.arguments import fork_request
from tether.client.cli_commands import (
    UsageError,
    client_command,
    connect_cli,
    expires_in_of,
    expiry_argument,
    flag_checked,
    handle_of,
    parse_input,
    parse_parent,
    waiting_line,
)
from tether.command_line import Command
from tether.config import Settings
from tether.contract.messages import DetachedHandle
from tether.domain.branches import BranchDiff, Side, StepPair, diff, what_it_says
from tether.domain.ids import check_identifier
from tether.domain.recorded import ForkPoint

PREVIEW_CHARS = 100
# `runs` actions that read the projections only (no NATS).
READS_ONLY = frozenset({"show", "diff"})


def _runs_arguments(runs: argparse.ArgumentParser) -> None:
    actions = runs.add_subparsers(dest="runs_action", required=True)
    show = actions.add_parser("show", help="steps, tool calls, usage and timings of one run, "
                                           "from the projections")
    show.add_argument("run_id")
    show.add_argument("--parent", required=True, metavar="AGENT/NAME")
    show.add_argument("--json", action="store_true", help="the projected run state as JSON")
    fork = actions.add_parser("fork", help="run a run again from a step, beside it, reusing "
                                           "what it recorded before")
    fork.add_argument("parent", metavar="AGENT/NAME")
    fork.add_argument("run_id")
    fork.add_argument("--at", required=True, metavar="POINT",
                      help="step:<n> (steps before n are reused; a number alone is a step), "
                           "milestone:<name> or seq:<n>")
    fork.add_argument("--input", metavar="JSON", help="the fork's input (default: the run's)")
    fork.add_argument("--instructions", help="a model agent's instructions from the fork on")
    fork.add_argument("--model", help="a model agent's model from the fork on")
    fork.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                      help="another of the agent's overrides (repeatable)")
    fork.add_argument("--id", dest="fork_id", metavar="RUN_ID",
                      help="the fork's run id (default: made from the point, input and "
                           "overrides, so the same fork asked again is one fork)")
    fork.add_argument("--detached", action="store_true", help="return a handle at once")
    expiry_argument(fork, "the fork's request")
    rewind = actions.add_parser("rewind", help="take a failed run up again from its last "
                                               "recorded step")
    rewind.add_argument("parent", metavar="AGENT/NAME")
    rewind.add_argument("run_id")
    rewind.add_argument("--detached", action="store_true", help="return a handle at once")
    expiry_argument(rewind, "the rewind's request")
    compare = actions.add_parser("diff", help="two runs side by side, from where they part "
                                              "(steps, output, usage, outcome)")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    compare.add_argument("--parent", required=True, metavar="AGENT/NAME")


def _run_runs(args: argparse.Namespace, settings: Settings) -> int:
    action = args.runs_action
    if action in ("fork", "rewind"):
        return client_command(_fork if action == "fork" else _rewind)(args, settings)
    try:
        parent = parse_parent(args.parent)
    except ValueError as error:
        print(f"tether runs {action}: {error}", file=sys.stderr)
        return 2
    try:
        if action == "show":
            return asyncio.run(show_run(settings, parent, args.run_id, as_json=args.json))
        return asyncio.run(_diff(settings, parent, args.run_a, args.run_b))
    except asyncpg.UndefinedTableError:
        print(f"tether runs {action}: {no_projections(settings)}", file=sys.stderr)
        return 1


def no_projections(settings: Settings) -> str:
    return (f"the projections are not in schema {settings.projection_schema!r} "
            "(TETHER_PROJECTION_SCHEMA) of TETHER_DATABASE_URL: start the projector (it "
            "creates them) or run `tether projections migrate`")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in args.override:
        key, equals, text = item.partition("=")
        if not equals or not key:
            raise UsageError(f"--override {item!r}: expected KEY=JSON, e.g. max_steps=3")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"--override {key}: the value is not JSON: {error}") from None
    for key in ("instructions", "model"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    return overrides


def _fork(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    check_identifier(args.run_id, "run id")
    try:
        point = str(ForkPoint.parse(args.at))
    except ValueError as error:
        raise UsageError(f"--{error}") from None
    input = parse_input(args.input) if args.input is not None else None
    overrides = _overrides(args)
    flag_checked(lambda: fork_request(args.run_id, point, overrides), "--at")
    if args.fork_id is not None:
        flag_checked(lambda: check_identifier(args.fork_id, "run id"), "--id")
    expires_in = expires_in_of(args)

    async def fork() -> int:
        async with connect_cli(settings) as tether:
            result = await handle_of(tether, ref).fork(
                args.run_id, at=args.at, input=input, agent_overrides=overrides or None,
                fork_id=args.fork_id, detached=args.detached, expires_in=expires_in,
                on_waiting=waiting_line(None, "runs fork"))
        print(result.model_dump_json(indent=2))
        return _exit_code(result)

    return fork()


def _rewind(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    check_identifier(args.run_id, "run id")
    expires_in = expires_in_of(args)

    async def rewind() -> int:
        async with connect_cli(settings) as tether:
            result = await handle_of(tether, ref).rewind(
                args.run_id, detached=args.detached, expires_in=expires_in,
                on_waiting=waiting_line(None, "runs rewind"))
        print(result.model_dump_json(indent=2))
        return _exit_code(result)

    return rewind()


def _exit_code(result: Any) -> int:
    """0 for a run that succeeded, or a detached one its parent took; else 1."""
    if isinstance(result, DetachedHandle):
        return 0 if result.error is None else 1
    return 0 if getattr(result, "ok", False) else 1


async def _diff(settings: Settings, parent, run_a: str, run_b: str,
                out: TextIO | None = None) -> int:
    states = [await load_run(settings, parent, run_id) for run_id in (run_a, run_b)]
    for run_id, state in zip((run_a, run_b), states, strict=True):
        if state is None:
            print(f"tether runs diff: no run {run_id!r} of {parent.agent}/{parent.name} in the "
                  f"projections (schema {settings.projection_schema})", file=sys.stderr)
            return 1
    a, b = states
    assert a is not None and b is not None
    print(render_diff(diff(a, b)), file=out or sys.stdout)
    return 0


def render_diff(compared: BranchDiff) -> str:
    """Two runs side by side: each one's outcome, usage and where it came from, then the
    steps from where they part, then their output."""
    a, b = compared.a, compared.b
    lines = [_side("a", a), _side("b", b)]
    if compared.diverged_at is None:
        lines.append(f"steps     the same for the first {compared.shared} "
                     f"({'equal' if a.steps == b.steps else 'one goes on further'})")
    else:
        lines.append(f"steps     the same for the first {compared.shared}; they part at step "
                     f"{compared.diverged_at}")
    lines += [line for pair in compared.steps for line in _pair(pair)]
    if compared.same_output:
        lines.append("output    the same")
    else:
        lines += [f"output a  {_output(a)}", f"output b  {_output(b)}"]
    return "\n".join(lines)


def _side(label: str, side: Side) -> str:
    said = side.summary if side.status == "completed" else side.error
    origin = (f"  forked from {side.forked_from} at sequence {side.fork_seq}"
              if side.forked_from else "")
    return (f"{label}  {side.run_id}  {side.agent_type}  {side.status}  {side.steps} steps  "
            f"{side.usage.tokens:,} tokens ${side.usage.cost:.6f} "
            f"(spent {side.spent.tokens:,}){origin}  -> {preview(said or '', PREVIEW_CHARS)}")


def _pair(pair: StepPair) -> list[str]:
    mark = "=" if pair.same else "≠"
    return [f"step {pair.index:<4}{mark} a {_step(pair.a)}",
            f"           b {_step(pair.b)}"]


def _step(step: dict[str, Any] | None) -> str:
    return "—" if step is None else compact(what_it_says(step), PREVIEW_CHARS)


def _output(side: Side) -> str:
    if side.output_text:
        return preview(side.output_text, PREVIEW_CHARS)
    return compact(side.output, PREVIEW_CHARS)


RUNS = Command("runs", "a run's recorded steps; fork, rewind and compare runs (DevTools)",
               _runs_arguments, _run_runs)
