"""The client subcommands of the `tether` CLI: run, watch, inspect, cancel, clear, hooks.

Exit codes: 0 success, 1 a failed run, an unknown run or an unreachable server (named, with
its URL), 2 bad arguments (checked before anything is sent, with a one-line message).
"""

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TextIO

import nats.errors
from nats.js.errors import BucketNotFoundError, NoKeysError, NotFoundError

from tether.client.arguments import build_run_command, check_seconds, expires_in_ms, new_run_id
from tether.client.connection import Tether, connect, input_size
from tether.client.errors import NotPermitted, TetherError
from tether.client.hooks import consumer_name
from tether.client.parent import ParentHandle
from tether.client.render import FINAL_STATUSES, Board, run_line, timeline_lines, timeline_rows
from tether.client.timeline import TimelineView
from tether.command_line import Command
from tether.config import Settings
from tether.domain.commands import MAX_EXPIRES_IN_MS, MAX_STEERING_TEXT
from tether.domain.events import ParentRef
from tether.domain.ids import check_identifier
from tether.ports import SYSTEM_CLOCK

STATUSES = ("starting", "running", "completed", "error", "aborted", "interrupted")


# The CLI gives up on an unreachable NATS sooner than an application would.
CLI_CONNECT_TIMEOUT_S = 3.0
FINAL_FRAME_WAIT_S = 2.0
CLEAR_WAIT_S = 10.0
# The expiry of the commands the CLI sends (`--expires-in`): one typed while no parent
# service runs is not applied by a parent started much later.
CLI_EXPIRES_IN_S = 60.0
STDIN = "-"


class UsageError(ValueError):
    pass


def connect_cli(settings: Settings):
    return connect(settings=settings, name="tether-cli", connect_timeout=CLI_CONNECT_TIMEOUT_S)


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("agent_type")
    run.add_argument("--parent", required=True, metavar="AGENT/NAME")
    run.add_argument("--input", default="{}", metavar="JSON",
                     help="a JSON object (default {}); @PATH reads it from a file, - from stdin")
    run.add_argument("--run-id", help="idempotency key (default: a new id)")
    run.add_argument("--detached", action="store_true", help="return a handle at once")
    run.add_argument("--on-finish", metavar="METHOD", help="finish hook method (implies --detached)")
    run.add_argument("--timeout", type=float, help="stop waiting after this many seconds")
    run.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    expiry_argument(run, "a run request")


def _watch_arguments(watch: argparse.ArgumentParser) -> None:
    watch.add_argument("parent", metavar="AGENT/NAME")
    watch.add_argument("--run-id", help="only this run")
    watch.add_argument("--once", action="store_true", help="print the current view and exit")


def _inspect_arguments(inspect: argparse.ArgumentParser) -> None:
    inspect.add_argument("parent", metavar="AGENT/NAME")
    inspect.add_argument("run_id", nargs="?")
    inspect.add_argument("--status", help="when listing: only these statuses, comma-separated")
    inspect.add_argument("--limit", type=int, default=100)


def _cancel_arguments(cancel: argparse.ArgumentParser) -> None:
    cancel.add_argument("parent", metavar="AGENT/NAME")
    cancel.add_argument("run_id")
    expiry_argument(cancel, "the cancel")


def _send_arguments(send: argparse.ArgumentParser) -> None:
    send.add_argument("parent", metavar="AGENT/NAME")
    send.add_argument("run_id")
    send.add_argument("text", nargs="?", help="what to tell the run's child")
    send.add_argument("--data", metavar="JSON", help="data for the child, as a JSON value")
    send.add_argument("--interrupt", action="store_true",
                      help="stop the child's current model or tool call first")
    send.add_argument("--id", dest="message_id", metavar="ID",
                      help="the message's id (default: a new one); sent again, it is "
                           "recorded once")
    expiry_argument(send, "the message")


def _clear_arguments(clear: argparse.ArgumentParser) -> None:
    clear.add_argument("parent", metavar="AGENT/NAME")
    clear.add_argument("--status", help="only these statuses, comma-separated")
    clear.add_argument("--older-than-ms", type=int, metavar="N",
                       help="only runs requested more than N ms ago")
    expiry_argument(clear, "the clear")


def _hooks_arguments(hooks: argparse.ArgumentParser) -> None:
    hooks.add_argument("parent_agent", metavar="AGENT")


def expiry_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--expires-in", type=float, default=CLI_EXPIRES_IN_S, metavar="S",
        help=f"{what} that no parent service takes within S seconds is never applied "
             f"(default {CLI_EXPIRES_IN_S:g}; 0: no expiry)")


def expires_in_of(args: argparse.Namespace) -> float | None:
    if args.expires_in < 0:
        raise UsageError("--expires-in must not be negative")
    if not args.expires_in:
        return None
    try:
        expires_in_ms(args.expires_in)
    except ValueError:
        raise UsageError(f"--expires-in must be more than 0 and at most "
                         f"{MAX_EXPIRES_IN_MS // 1000} seconds (0: no expiry), not "
                         f"{args.expires_in!r}") from None
    return args.expires_in


def flag_checked(check: Callable[[], Any], flag: str) -> Any:
    """`check()`'s value; its ValueError is a UsageError naming the flag."""
    try:
        return check()
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None


def client_command(handler) -> "Callable[[argparse.Namespace, Settings], int]":
    """A client command's `run`: its coroutine, with the CLI's exit codes."""
    def run(args: argparse.Namespace, settings: Settings) -> int:
        try:
            coroutine = handler(args, settings)
        except (ValueError, TypeError) as error:
            print(f"tether {args.command}: {error}", file=sys.stderr)
            return 2
        try:
            return asyncio.run(coroutine)
        except TetherError as error:
            print(f"tether {args.command}: {error}", file=sys.stderr)
            return 1
        except (ValueError, TypeError) as error:
            # A net under the synchronous checks: an argument refused only once the
            # command runs is still a usage error, in one line.
            print(f"tether {args.command}: {error}", file=sys.stderr)
            return 2
        except (TimeoutError, nats.errors.Error) as error:
            print(f"tether {args.command}: {error or type(error).__name__}", file=sys.stderr)
            return 1

    return run


def parse_parent(text: str) -> ParentRef:
    agent, slash, name = text.partition("/")
    if not slash:
        raise UsageError(f"parent {text!r}: expected AGENT/NAME, e.g. Assistant/user-42")
    return ParentRef(agent=check_identifier(agent, "parent agent"),
                     name=check_identifier(name, "parent name"))


def parse_input(text: str, stdin: TextIO | None = None) -> dict[str, Any]:
    """`--input`: JSON text, `@PATH` for a file's contents, `-` for standard input."""
    source = "--input"
    if text == STDIN:
        source, text = "--input - (standard input)", (stdin or sys.stdin).read()
    elif text.startswith("@"):
        path = text[1:]
        source = f"--input @{path}"
        try:
            with open(path, encoding="utf-8") as file:
                text = file.read()
        except OSError as error:
            raise UsageError(f"{source}: cannot read {path}: {error.strerror or error}") from None
        except UnicodeDecodeError as error:
            raise UsageError(f"{source}: {path} is not UTF-8 text: {error.reason}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a JSON object, not {type(value).__name__}")
    return value


def check_input_size(input: dict[str, Any], settings: Settings) -> None:
    size, limit = input_size(input), settings.max_input_bytes
    if size > limit:
        raise UsageError(f"--input is {size:,} bytes; the limit is {limit:,} bytes "
                         "(TETHER_MAX_INPUT_BYTES); nothing was sent")


def parse_statuses(text: str | None) -> list[str] | None:
    if text is None:
        return None
    statuses = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(statuses) - set(STATUSES))
    if unknown or not statuses:
        raise UsageError(f"--status {text!r}: expected some of {', '.join(STATUSES)}")
    return statuses


def handle_of(tether: Tether, ref: ParentRef) -> ParentHandle:
    return tether.parent(ref.agent, ref.name)


# Each command checks its arguments synchronously (so bad ones exit 2 before anything is
# sent) and returns the coroutine that does the work.

def _run(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    detached: bool | dict[str, Any] = {"on_finish": args.on_finish} if args.on_finish else args.detached
    input = parse_input(args.input)
    check_input_size(input, settings)
    command = build_run_command(ref, args.agent_type, input,
                                run_id=args.run_id or new_run_id(), parent_tool_call_id=None,
                                display_order=None, display=None, detached=detached)
    if args.timeout is not None:
        try:
            check_seconds(args.timeout, "--timeout", none_allowed=False)
        except ValueError as error:
            raise UsageError(str(error)) from None
    expires_in = expires_in_of(args)

    async def run() -> int:
        async with connect_cli(settings) as tether:
            me = handle_of(tether, ref)
            board = None if detached or args.quiet else Board(sys.stderr)
            with board or nullcontext():
                bar = None
                if board is not None:
                    bar = asyncio.create_task(_progress(me, command.run_id, board))
                try:
                    result = await me.run_agent_tool(
                        command.agent_type, command.input, run_id=command.run_id,
                        detached=command.detached, timeout=args.timeout,
                        expires_in=expires_in, on_waiting=waiting_line(board))
                except asyncio.CancelledError:
                    # Ctrl-C: an awaited run is cancelled with its caller (run_agent_tool
                    # has sent the cancel by now); a detached one goes on, if it started.
                    _say(board, _interrupted(ref, command.run_id, detached))
                    raise
                else:
                    if bar is not None:
                        # The answer can arrive before the timeline's last event: let
                        # the bar end on the run's final status.
                        await asyncio.wait({bar}, timeout=FINAL_FRAME_WAIT_S)
                finally:
                    if bar is not None:
                        await _stop(bar)
        print(result.model_dump_json(indent=2))
        if getattr(result, "status", None) == "running":
            return 0
        return 0 if getattr(result, "ok", False) else 1

    return run()


def _interrupted(ref: ParentRef, run_id: str, detached: Any) -> str:
    where = f"tether inspect {ref.agent}/{ref.name} {run_id}"
    if detached:
        return (f"tether run: interrupted; the detached run {run_id} goes on if its request "
                f"was taken: {where}")
    return f"tether run: interrupted; run {run_id} is cancelled (its cancel was sent): {where}"


def _say(board: Board | None, text: str) -> None:
    """A line of `tether run`'s: above its live line, else on stderr."""
    if board is not None:
        board.say(text)
    else:
        print(text, file=sys.stderr, flush=True)


def waiting_line(board: Board | None, command: str = "run"):
    return lambda text: _say(board, f"tether {command}: waiting: {text}")


async def _stop(task: asyncio.Task) -> None:
    # Python 3.11's wait_for (inside nats-py requests) can swallow a cancellation that
    # lands just as a request completes: cancel until the task has really ended.
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)


async def _progress(me: ParentHandle, run_id: str, board: Board) -> None:
    """The run's line, until it shows the run's final status."""
    async for view in me.timeline(run_id=run_id):
        run = view.runs.get(run_id)
        if run is None:
            continue
        board.show([(run_id, run_line(run, width=board.bar_width, columns=board.columns))])
        if run.status in FINAL_STATUSES:
            return


def _watch(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    if args.run_id is not None:
        check_identifier(args.run_id, "run id")

    async def watch() -> int:
        async with connect_cli(settings) as tether:
            me = handle_of(tether, ref)
            if args.once:
                view = TimelineView({})
                async for view in me.timeline(run_id=args.run_id, live=False):  # noqa: B007 - the last view is the one shown
                    pass
                if args.run_id is not None and args.run_id not in view.runs:
                    print(f"tether watch: {not_found(ref, args.run_id)}", file=sys.stderr)
                    return 1
                print("\n".join(timeline_lines(view)))
                return 0
            with Board(sys.stdout) as board:
                async for view in me.timeline(run_id=args.run_id):
                    board.show(timeline_rows(view, width=board.bar_width,
                                             columns=board.columns))
        return 0

    return watch()


def not_found(ref: ParentRef, run_id: str) -> str:
    return f"run {run_id} not found: parent {ref.agent}/{ref.name} has no such run"


def _inspect(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    statuses = parse_statuses(args.status)
    if args.run_id is not None:
        check_identifier(args.run_id, "run id")
    if not 0 < args.limit <= 10_000:
        raise UsageError("--limit must be between 1 and 10000")

    async def inspect() -> int:
        async with connect_cli(settings) as tether:
            me = handle_of(tether, ref)
            if args.run_id is None:
                runs = await me.list_runs(statuses, args.limit)
                print(json.dumps([run.model_dump(mode="json") for run in runs], indent=2))
                return 0
            snapshot = await me.inspect(args.run_id)
        if snapshot is None:
            print(f"tether inspect: {not_found(ref, args.run_id)}", file=sys.stderr)
            return 1
        print(snapshot.model_dump_json(indent=2))
        return 0

    return inspect()


def _cancel(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    check_identifier(args.run_id, "run id")
    expires_in = expires_in_of(args)

    async def cancel() -> int:
        async with connect_cli(settings) as tether:
            me = handle_of(tether, ref)
            snapshot = await me.inspect(args.run_id)
            if snapshot is None:
                print(f"tether cancel: {not_found(ref, args.run_id)}", file=sys.stderr)
                return 1
            if snapshot.status in FINAL_STATUSES:
                print(f"run {args.run_id} is already {snapshot.status}: nothing to cancel")
                return 0
            await me.cancel(args.run_id, expires_in=expires_in)
        print(f"cancel requested for run {args.run_id} ({snapshot.status})")
        return 0

    return cancel()


def _send(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    check_identifier(args.run_id, "run id")
    try:
        data = None if args.data is None else json.loads(args.data)
    except json.JSONDecodeError as error:
        raise ValueError(f"--data is not JSON: {error}") from None
    if args.text is None and data is None:
        raise ValueError("give the message's text, --data, or both")
    if args.text is not None and not args.text.strip():
        raise UsageError("the message's text is empty: give some text, or --data alone")
    if args.text is not None and len(args.text) > MAX_STEERING_TEXT:
        raise UsageError(f"the message's text is {len(args.text):,} characters; the limit "
                         f"is {MAX_STEERING_TEXT:,}")
    if args.message_id is not None:
        flag_checked(lambda: check_identifier(args.message_id, "message id"), "--id")
    expires_in = expires_in_of(args)

    async def send() -> int:
        async with connect_cli(settings) as tether:  # (a refusal: `MessageRefused`, said)
            receipt = await handle_of(tether, ref).send(
                args.run_id, args.text, data=data,
                mode="interrupt" if args.interrupt else "queue",
                message_id=args.message_id, expires_in=expires_in,
                on_waiting=waiting_line(None, "send"))
        print(f"message {receipt.message_id} recorded for run {args.run_id} ({receipt.mode}): "
              "its child takes it in at its next step")
        return 0

    return send()


def _clear(args: argparse.Namespace, settings: Settings):
    ref = parse_parent(args.parent)
    statuses = parse_statuses(args.status)
    expires_in = expires_in_of(args)
    older_than = None
    if args.older_than_ms is not None:
        if args.older_than_ms < 0:
            raise UsageError("--older-than-ms must not be negative")
        older_than = max(SYSTEM_CLOCK.now() - args.older_than_ms, 0)

    def matches(run) -> bool:
        return ((statuses is None or run.status in statuses)
                and (older_than is None or run.requested_at < older_than))

    async def clear() -> int:
        async with connect_cli(settings) as tether:
            me = handle_of(tether, ref)
            # The parent clears asynchronously; the parent's timeline shows each cleared
            # run leave it, so the count printed is what was cleared, not what was asked.
            timeline = me.timeline()
            try:
                view = await anext(timeline)
                while not view.caught_up:
                    view = await anext(timeline)
                chosen = {run_id for run_id, run in view.runs.items() if matches(run)}
                if not chosen:
                    print(f"cleared 0 runs of {ref.agent}/{ref.name}: none matched")
                    return 0
                await me.clear(status=statuses, older_than=older_than, expires_in=expires_in)
                remaining = set(chosen)
                try:
                    async with asyncio.timeout(CLEAR_WAIT_S):
                        while remaining:
                            view = await anext(timeline)
                            remaining = {run_id for run_id in remaining if run_id in view.runs}
                except TimeoutError:
                    pass
            finally:
                await timeline.aclose()
        cleared = len(chosen) - len(remaining)
        print(f"cleared {cleared} run{'s' if cleared != 1 else ''} of {ref.agent}/{ref.name}")
        if remaining:
            later = ("a parent service started later still applies it, to these runs only"
                     if expires_in is None else
                     f"a parent service that takes it more than {expires_in:g} s after it "
                     "was sent does not apply it (--expires-in)")
            print(f"tether clear: {len(remaining)} matching runs were still there after "
                  f"{CLEAR_WAIT_S:g} s (is the parent service running?): "
                  f"{', '.join(sorted(remaining))}; {later}", file=sys.stderr)
            return 1
        return 0

    return clear()


def _hooks(args: argparse.Namespace, settings: Settings):
    agent = check_identifier(args.parent_agent, "parent agent")

    async def hooks() -> int:
        async with connect_cli(settings) as tether:
            if tether.served:
                raise NotPermitted(
                    "this NATS user's account has no JetStream API (an application in an "
                    "account of its own, tether.access), and tether hooks reads the hook "
                    "registry and the hook consumers through it: run it with the "
                    "operator's credentials")
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


COMMANDS = (
    Command("run", "run a child agent and print its result as JSON", _run_arguments,
            client_command(_run)),
    Command("watch", "follow a parent's runs live until Ctrl-C", _watch_arguments,
            client_command(_watch)),
    Command("inspect", "one run as JSON, or the parent's runs", _inspect_arguments,
            client_command(_inspect)),
    Command("cancel", "cancel a run", _cancel_arguments, client_command(_cancel)),
    Command("send", "send a message to a running run's child (steering)", _send_arguments,
            client_command(_send)),
    Command("clear", "clear retained runs (open ones are cancelled)", _clear_arguments,
            client_command(_clear)),
    Command("hooks", "registered finish hooks of a parent agent", _hooks_arguments,
            client_command(_hooks)),
)
