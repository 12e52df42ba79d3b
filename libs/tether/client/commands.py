"""The client subcommands of the `tether` CLI: run, watch, inspect, cancel, clear, hooks.

Exit codes: 0 success, 1 a failed run or an unreachable service, 2 bad arguments (checked
before anything is sent, with a one-line message).
"""

import argparse
import asyncio
import json
import sys
import time
from typing import Any, TextIO

import nats.errors
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError

from tether.client.connection import Tether, connect
from tether.client.errors import TetherError
from tether.client.parent import ParentHandle, build_run_command, new_run_id
from tether.client.render import run_line, timeline_lines
from tether.config import Settings
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier

CLIENT_COMMANDS = ("run", "watch", "inspect", "cancel", "clear", "hooks")
STATUSES = ("starting", "running", "completed", "error", "aborted", "interrupted")


class UsageError(ValueError):
    pass


def add_client_commands(commands: "argparse._SubParsersAction") -> None:
    run = commands.add_parser("run", help="run a child agent and print its result as JSON")
    run.add_argument("agent_type")
    run.add_argument("--parent", required=True, metavar="AGENT/NAME")
    run.add_argument("--input", default="{}", metavar="JSON", help="a JSON object (default {})")
    run.add_argument("--run-id", help="idempotency key (default: a new id)")
    run.add_argument("--detached", action="store_true", help="return a handle at once")
    run.add_argument("--on-finish", metavar="METHOD", help="finish hook method (implies --detached)")
    run.add_argument("--timeout", type=float, help="stop waiting after this many seconds")
    run.add_argument("--quiet", action="store_true", help="no progress bar on stderr")

    watch = commands.add_parser("watch", help="follow a parent's runs live until Ctrl-C")
    watch.add_argument("parent", metavar="AGENT/NAME")
    watch.add_argument("--run-id", help="only this run")
    watch.add_argument("--once", action="store_true", help="print the current view and exit")

    inspect = commands.add_parser("inspect", help="one run as JSON, or the parent's runs")
    inspect.add_argument("parent", metavar="AGENT/NAME")
    inspect.add_argument("run_id", nargs="?")
    inspect.add_argument("--status", help="when listing: only these statuses, comma-separated")
    inspect.add_argument("--limit", type=int, default=100)

    cancel = commands.add_parser("cancel", help="cancel a run")
    cancel.add_argument("parent", metavar="AGENT/NAME")
    cancel.add_argument("run_id")

    clear = commands.add_parser("clear", help="clear retained runs (open ones are cancelled)")
    clear.add_argument("parent", metavar="AGENT/NAME")
    clear.add_argument("--status", help="only these statuses, comma-separated")
    clear.add_argument("--older-than-ms", type=int, metavar="N",
                       help="only runs requested more than N ms ago")

    hooks = commands.add_parser("hooks", help="registered finish hooks of a parent agent")
    hooks.add_argument("parent_agent", metavar="AGENT")


def run_client_command(args: argparse.Namespace, settings: Settings) -> int:
    handlers = {"run": _run, "watch": _watch, "inspect": _inspect, "cancel": _cancel,
                "clear": _clear, "hooks": _hooks}
    try:
        coroutine = handlers[args.command](args, settings)
    except (ValueError, TypeError) as error:
        print(f"tether {args.command}: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(coroutine)
    except TetherError as error:
        print(f"tether {args.command}: {error}", file=sys.stderr)
        return 1
    except (TimeoutError, nats.errors.Error) as error:
        print(f"tether {args.command}: {error or type(error).__name__}", file=sys.stderr)
        return 1


def parse_parent(text: str) -> ParentRef:
    agent, slash, name = text.partition("/")
    if not slash:
        raise UsageError(f"parent {text!r}: expected AGENT/NAME, e.g. Assistant/user-42")
    return ParentRef(agent=check_identifier(agent, "parent agent"),
                     name=check_identifier(name, "parent name"))


def parse_input(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--input is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--input must be a JSON object, not {type(value).__name__}")
    return value


def parse_statuses(text: str | None) -> list[str] | None:
    if text is None:
        return None
    statuses = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(statuses) - set(STATUSES))
    if unknown or not statuses:
        raise UsageError(f"--status {text!r}: expected some of {', '.join(STATUSES)}")
    return statuses


def _handle(tether: Tether, ref: ParentRef) -> ParentHandle:
    return tether.parent(ref.agent, ref.name)


# Each command checks its arguments synchronously (so bad ones exit 2 before anything is
# sent) and returns the coroutine that does the work.

def _run(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    detached: bool | dict[str, Any] = {"on_finish": args.on_finish} if args.on_finish else args.detached
    command = build_run_command(ref, args.agent_type, parse_input(args.input),
                                run_id=args.run_id or new_run_id(), parent_tool_call_id=None,
                                display_order=None, display=None, detached=detached)
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be positive")

    async def run() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            me = _handle(tether, ref)
            bar = None
            if not detached and not args.quiet:
                bar = asyncio.create_task(_progress(me, command.run_id, sys.stderr))
            try:
                result = await me.run_agent_tool(
                    command.agent_type, command.input, run_id=command.run_id,
                    detached=command.detached, timeout=args.timeout)
            finally:
                if bar is not None:
                    await _stop(bar)
        print(result.model_dump_json(indent=2))
        if getattr(result, "status", None) == "running":
            return 0
        return 0 if getattr(result, "ok", False) else 1

    return run()


async def _stop(task: asyncio.Task) -> None:
    # Python 3.11's wait_for (inside nats-py requests) can swallow a cancellation that
    # lands just as a request completes: cancel until the task has really ended.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)


async def _progress(me: ParentHandle, run_id: str, out: TextIO) -> None:
    """The run's line on stderr: redrawn in place on a terminal, a new line per change otherwise."""
    tty = out.isatty()
    shown = ""
    try:
        async for view in me.timeline(run_id=run_id):
            run = view.runs.get(run_id)
            if run is None or (line := run_line(run)) == shown:
                continue
            shown = line
            if tty:
                print("\r\x1b[2K" + line, end="", file=out, flush=True)
            else:
                print(line, file=out, flush=True)
    finally:
        if tty and shown:
            print(file=out, flush=True)


def _watch(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    if args.run_id is not None:
        check_identifier(args.run_id, "run id")

    async def watch() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            me = _handle(tether, ref)
            tty = sys.stdout.isatty() and not args.once
            drawn = 0
            async for view in me.timeline(run_id=args.run_id, live=not args.once):
                if args.once:
                    continue
                if tty:
                    lines = timeline_lines(view)
                    up = f"\x1b[{drawn}F\x1b[J" if drawn else ""
                    print(up + "\n".join(lines), flush=True)
                    drawn = len(lines)
                else:
                    changed = [view.runs[run_id] for run_id in sorted(view.changed)
                               if run_id in view.runs]
                    for run in changed:
                        print(run_line(run), flush=True)
                    if not view.runs and view.caught_up and not changed:
                        print("(no runs yet)", flush=True)
            if args.once:
                print("\n".join(timeline_lines(view)))
        return 0

    return watch()


def _inspect(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    statuses = parse_statuses(args.status)
    if args.run_id is not None:
        check_identifier(args.run_id, "run id")
    if not 0 < args.limit <= 10_000:
        raise UsageError("--limit must be between 1 and 10000")

    async def inspect() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            me = _handle(tether, ref)
            if args.run_id is None:
                runs = await me.list_runs(statuses, args.limit)
                print(json.dumps([run.model_dump(mode="json") for run in runs], indent=2))
                return 0
            snapshot = await me.inspect(args.run_id)
        if snapshot is None:
            print(f"tether inspect: {ref.agent}/{ref.name} has no run {args.run_id}",
                  file=sys.stderr)
            return 1
        print(snapshot.model_dump_json(indent=2))
        return 0

    return inspect()


def _cancel(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    check_identifier(args.run_id, "run id")

    async def cancel() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            await _handle(tether, ref).cancel(args.run_id)
        print(f"cancel requested for {args.run_id}")
        return 0

    return cancel()


def _clear(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    statuses = parse_statuses(args.status)
    older_than = None
    if args.older_than_ms is not None:
        if args.older_than_ms < 0:
            raise UsageError("--older-than-ms must not be negative")
        older_than = max(int(time.time() * 1000) - args.older_than_ms, 0)

    async def clear() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            await _handle(tether, ref).clear(status=statuses, older_than=older_than)
        print(f"clear requested for {ref.agent}/{ref.name}")
        return 0

    return clear()


def _hooks(args: argparse.Namespace, settings: Settings):
    from tether.client.hooks import consumer_name

    agent = check_identifier(args.parent_agent, "parent agent")

    async def hooks() -> int:
        async with connect(settings=settings, name="tether-cli") as tether:
            prefix = f"hook.{agent}."
            try:
                bucket = await tether.js.key_value(tether.subjects.registry_bucket)
                keys = sorted(key for key in await bucket.keys() if key.startswith(prefix))
            except (BucketNotFoundError, NoKeysError):
                keys = []
            if not keys:
                print(f"no hook handler has registered for {agent}")
                return 0
            for key in keys:
                method = key[len(prefix):]
                registered = json.loads((await bucket.get(key)).value or b"{}")
                try:
                    info = await tether.js.consumer_info(tether.subjects.hooks_stream,
                                                         consumer_name(agent, method))
                    queue = (f"pending {info.num_pending}, in delivery {info.num_ack_pending}, "
                             f"redelivered {info.num_redelivered}")
                except NotFoundError:
                    queue = "no consumer"
                print(f"{method}: registered_at {registered.get('registered_at')}; {queue}")
        return 0

    return hooks()
