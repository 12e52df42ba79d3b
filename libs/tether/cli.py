"""The `tether` command for operators and developers."""

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import asyncpg

from tether.client.branch_commands import READS_ONLY, RUNS
from tether.client.cli_commands import COMMANDS as CLIENT_COMMANDS
from tether.command_line import Command
from tether.config import CONFIG_FILE_VARIABLE, ConfigurationError, Settings, load_config_file
from tether.diagnose import (
    CannotListen,
    StartupFailed,
    is_address_in_use,
    nats_unreachable,
    postgres_unreachable,
    unreachable_servers,
)
from tether.extras import MissingExtra, installed, require
from tether.log import configure_logging, get_logger
from tether.resilience import ABANDON_WAIT_S

SERVICE_HEALTH_PORTS = {"parent": 8081, "child-runner": 8082, "reconciler": 8083, "projector": 8084,
                        "ui": 8085, "gateway": 8086}
ALL_SERVICES_HEALTH_PORT = 8080
# `tether ui` on the default port, taken: the next free one of these, else any.
UI_PORT_TRIES = 10
NATS_CONNECT_TIMEOUT_S = 5.0
# When one of `tether services all` fails, how long the others get to stop on their own.
ALL_STOP_S = 3.0


class CommandFailed(Exception):
    """A command could not do its work; the message says why and what to check."""


SERVICE_MODULES = {"parent": "tether_services.parent",
                   "child-runner": "tether_services.child_runner",
                   "reconciler": "tether_services.reconciler",
                   "projector": "tether_services.projector",
                   "ui": "tether_services.ui",
                   "gateway": "tether_services.gateway"}


def _services(names: list[str]) -> dict[str, Callable[..., Awaitable[None]]]:
    """The `serve` of each named service, importing only those: a process that runs one
    service starts without the others' modules."""
    import importlib

    return {name: importlib.import_module(SERVICE_MODULES[name]).serve for name in names}


def import_from_current_directory() -> None:
    """Find `--agents`, `TETHER_FORMATTERS` and `TETHER_MODEL_CLIENT` modules in the current
    directory first, as `python -m` does; the `tether` script's own directory is the venv's
    bin/, where no application code lives."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    import_from_current_directory()
    parser = argparse.ArgumentParser(prog="tether", description=__doc__)
    _global_flags(parser, None)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        # The global flags are taken after a command too (`tether inspect A/b --nats-url ...`).
        _accept_global_flags(command.register(commands))
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(config_file=args.config, nats_url=args.nats_url,
                                     database_url=args.database_url, prefix=args.prefix,
                                     agents=getattr(args, "agents", None),
                                     ui_host=getattr(args, "host", None),
                                     ui_port=getattr(args, "port", None))
        event_loop_factory(settings.event_loop)
    except ConfigurationError as error:
        print(f"tether: {error}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        return BY_NAME[args.command].run(args, settings)
    except MissingExtra as error:
        print(f"tether: {error}", file=sys.stderr)
        return 2
    except (CommandFailed, StartupFailed) as error:
        print(f"tether: {error}", file=sys.stderr)
        return 1
    except (OSError, asyncpg.PostgresError, ConnectionError) as error:
        # Drivers name an address at best: say which server does not answer.
        reads_only = args.command == "runs" and args.runs_action in READS_ONLY
        servers = (unreachable_servers(settings, nats=not reads_only)
                   if isinstance(error, OSError) else [])
        for message in servers or [f"{type(error).__name__}: {error}"]:
            print(f"tether: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _in_loop(settings: Settings, coroutine: Coroutine[Any, Any, int]) -> int:
    """A service command's coroutine, on the event loop the settings choose, and then an
    end: what it left running (a task abandoned at a stop, such as a NATS connect that
    does not end when cancelled) is cancelled and waited for `ABANDON_WAIT_S` at most,
    where `asyncio.Runner` would wait for it for ever."""
    factory = event_loop_factory(settings.event_loop)
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        try:
            end_remaining(loop)
        finally:
            loop.close()


def end_remaining(loop: asyncio.AbstractEventLoop, within_s: float = ABANDON_WAIT_S) -> None:
    """Cancel the loop's tasks that are still running and wait for them `within_s` at most;
    a task that does not end by then is left behind with the loop."""
    remaining = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in remaining:
        task.cancel()
    if remaining:
        loop.run_until_complete(asyncio.wait(remaining, timeout=within_s))
    loop.run_until_complete(loop.shutdown_asyncgens())


def _services_arguments(services: argparse.ArgumentParser) -> None:
    services.add_argument("name", type=_service_names,
                          help=f"{', '.join(sorted(SERVICE_MODULES))}, several of them "
                               "separated by commas (one process runs them), or all")
    services.add_argument("--agents", help="child agents, module:Class[,module:Class] "
                                           "(default: $TETHER_AGENTS)")


def _projections_arguments(projections: argparse.ArgumentParser) -> None:
    projections.add_argument("action", choices=["migrate", "rebuild", "verify"])
    projections.add_argument("--batch-size", type=int, default=5000)


def _ui_arguments(ui: argparse.ArgumentParser) -> None:
    ui.add_argument("--host", help="default: $TETHER_UI_HOST or 127.0.0.1")
    ui.add_argument("--port", type=_port, help="default: $TETHER_UI_PORT or 8090")


def _gateway_arguments(gateway: argparse.ArgumentParser) -> None:
    gateway.add_argument("--agents", help="the child agents to serve, module:Class[,...] "
                                          "(default: $TETHER_AGENTS)")


def _ui(args: argparse.Namespace, settings: Settings) -> int:
    require("ui")
    return _in_loop(settings, _run_ui(settings, _ui_listener(settings, _ui_port_asked(args))))


def _global_flags(parser: argparse.ArgumentParser, default: object) -> None:
    """The flags every command takes; after a command, their default is `default`
    (argparse.SUPPRESS: a flag given before the command is not overwritten)."""
    parser.add_argument("--nats-url", default=default, help="default: $TETHER_NATS_URL")
    parser.add_argument("--database-url", default=default,
                        help="default: $TETHER_DATABASE_URL")
    parser.add_argument("--prefix", default=default,
                        help="subject prefix (default: $TETHER_PREFIX or tether)")
    parser.add_argument("--config", metavar="PATH", default=default,
                        help="a TOML file of settings (default: $TETHER_CONFIG_FILE); the "
                             "environment and flags override it")


def _accept_global_flags(parser: argparse.ArgumentParser) -> None:
    subcommands = [action for action in parser._actions  # noqa: SLF001 - argparse's
                   if isinstance(action, argparse._SubParsersAction)]  # noqa: SLF001
    if not subcommands:
        _global_flags(parser, argparse.SUPPRESS)
    for action in subcommands:
        for command in action.choices.values():
            _accept_global_flags(command)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0 to 65535)")
    return int(text)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop for the services unless asked otherwise; None is asyncio's default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigurationError("TETHER_EVENT_LOOP=uvloop, but uvloop is not installed: "
                                     "pip install uvloop, or set TETHER_EVENT_LOOP=asyncio") from None
        return None
    return uvloop.new_event_loop


def _service_names(text: str) -> str:
    """`tether services NAME`: a service, several separated by commas, or `all`."""
    names = text.split(",")
    unknown = [name for name in names if name not in SERVICE_MODULES]
    if text != "all" and (unknown or len(set(names)) < len(names)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: name a service ({', '.join(sorted(SERVICE_MODULES))}), several of "
            "them once each, separated by commas, or all"
            + (f"; not a service: {', '.join(repr(name) for name in unknown)}" if unknown else ""))
    return text


def services_to_run(name: str, settings: Settings | None = None) -> list[str]:
    """What `tether services NAME` runs: one service, several named with commas, or
    `all`. The web timeline and the gateway are extras: without one, asking for its
    service is refused (`MissingExtra`) before anything starts, and `all` runs the
    others (the caller says so), since an install for running agents need not serve a
    web page. `all` runs the gateway only where its callers file is set (`settings`): it
    lets nobody in without one."""
    if name != "all":
        names = name.split(",")
        for extra in ("ui", "gateway"):
            if extra in names:
                require(extra)
        return names
    gateway = (settings is not None and settings.gateway_callers_file is not None
               and installed("gateway"))
    return [service for service in sorted(SERVICE_MODULES)
            if (service != "ui" or installed("ui")) and (service != "gateway" or gateway)]


def shared_in_process(chosen: list[str]) -> dict[str, dict[str, Any]]:
    """What the services of one process are handed beside their settings, by service: with
    the projector and the reconciler both there, the projector's committed batches, which
    the reconciler takes instead of following the log a second time
    (docs/architecture.md)."""
    if "projector" not in chosen or "reconciler" not in chosen:
        return {}
    from tether.adapters.postgres.committed_feed import CommittedFeed

    feed = CommittedFeed()
    return {"projector": {"feed": feed}, "reconciler": {"feed": feed}}


async def _run_services(settings: Settings, name: str) -> int:
    from tether.runtime import one_service_of_many

    chosen = services_to_run(name, settings)
    available = _services(chosen)
    shared = shared_in_process(chosen)
    if name == "all" and "ui" not in chosen:
        get_logger(service="all").warning(
            "ui.not_installed", detail=f"{MissingExtra('ui')}; the other services run")

    async def run_all(stop: asyncio.Event, checks: dict) -> None:
        # The first to fail (a dependency unreachable at start) stops the others, as a
        # SIGTERM would, and its error is the one the command says. One that has not
        # stopped within ALL_STOP_S (a start-up still waiting on a server) is cancelled.
        own = {service: checks for service in chosen}
        if len(chosen) > 1:  # each fills its own checks once started: till all have, not ready
            own = {service: {} for service in chosen}
            checks.update({service: one_service_of_many(service, own[service])
                           for service in chosen})
        running = [asyncio.ensure_future(available[service](settings, stop, own[service],
                                                            **shared.get(service, {})))
                   for service in chosen]
        try:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            stop.set()
            _, stopping = await asyncio.wait(running, timeout=ALL_STOP_S)
            for task in stopping:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        for task in done:
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error

    port = settings.health_port
    if port is None:
        port = SERVICE_HEALTH_PORTS.get(name, ALL_SERVICES_HEALTH_PORT)
    return await _serve(settings, name, run_all, settings.health_host, port)


async def _run_ui(settings: Settings, listener: socket.socket) -> int:
    from tether.ui.serving import serve_ui

    async def ui(stop: asyncio.Event, checks: dict) -> None:
        await serve_ui(settings, stop, checks, listener=listener)

    # A development UI beside the services (`tether services all` has one on 8090, its
    # health on 8080): health and metrics on this machine only, on a free port, unless
    # TETHER_HEALTH_PORT asks for one.
    if settings.health_port is None:
        return await _serve(settings, "ui", ui, "127.0.0.1", 0)
    return await _serve(settings, "ui", ui, settings.health_host, settings.health_port)


async def _serve(settings: Settings, name: str,
                 main: Callable[[asyncio.Event, dict], Awaitable[None]],
                 health_host: str, health_port: int) -> int:
    from tether.runtime import run_service, tune_gc

    tune_gc(settings.gc_threshold)
    try:
        await run_service(name, main, health_host=health_host, health_port=health_port)
    except CannotListen as error:
        raise CommandFailed(str(error)) from None
    except OSError as error:
        if not is_address_in_use(error):
            raise
        raise CommandFailed(
            f"cannot serve health and metrics on {health_host}:{health_port}: the port is "
            "in use (by another service?); set TETHER_HEALTH_PORT to a free port, or 0 for "
            "any") from None
    return 0


def _ui_port_asked(args: argparse.Namespace) -> str | None:
    """Where `tether ui`'s port was chosen (`--port 9000`, ...), or None: the default."""
    if args.port is not None:
        return f"--port {args.port}"
    if "TETHER_UI_PORT" in os.environ:
        return f"TETHER_UI_PORT={os.environ['TETHER_UI_PORT']}"
    config_file = args.config or os.environ.get(CONFIG_FILE_VARIABLE)
    if config_file and "ui_port" in load_config_file(Path(config_file)):
        return f"ui_port in {config_file}"
    return None


def _ui_listener(settings: Settings, asked_by: str | None) -> socket.socket:
    """`tether ui`'s socket. A port the user chose that is taken ends the command, naming
    the choice; the default port taken (another `tether ui`, or `tether services all`'s
    UI), the UI says so and takes the next free port, as a development server does."""
    from tether.ui.serving import listen_on

    host, port = settings.ui_host, settings.ui_port
    fallbacks = [] if asked_by is not None or port == 0 else [
        *range(port + 1, min(port + UI_PORT_TRIES, 65536)), 0]
    for candidate in [port, *fallbacks]:
        try:
            listener = listen_on(host, candidate)
        except OSError as error:
            if not is_address_in_use(error):
                raise CommandFailed(f"cannot serve the UI on {host}:{candidate}: "
                                    f"{error.strerror or error}; check --host "
                                    "(TETHER_UI_HOST)") from None
            if asked_by is not None:
                raise CommandFailed(
                    f"cannot serve the UI on {host}:{port} ({asked_by}): the port is in use; "
                    "choose another with --port or TETHER_UI_PORT (0: any free port)") from None
            continue
        if candidate != port:
            bound = listener.getsockname()[1]
            print(f"tether: port {port}, the default, is in use (another `tether ui`, or "
                  f"`tether services all`?): the UI is on http://{host}:{bound}/ instead; "
                  "--port or TETHER_UI_PORT chooses its port", file=sys.stderr, flush=True)
        return listener
    raise CommandFailed(f"cannot serve the UI on {host}: no free port")


async def _projections(settings: Settings, action: str, batch_size: int) -> int:
    from tether.adapters.event_log import EventLog
    from tether.adapters.postgres.migrator import migrate
    from tether.adapters.postgres.projector import rebuild, verify
    from tether.runtime import pause_gc_for_replay

    pause_gc_for_replay(settings.gc_threshold)
    schema = settings.projection_schema
    try:
        pool = await asyncpg.create_pool(settings.database_url, min_size=1, max_size=2)
    except OSError as error:
        raise CommandFailed(postgres_unreachable(settings.database_url, error)) from None
    try:
        if action == "migrate":
            async with pool.acquire() as conn:
                applied = await migrate(conn, schema)
            print(f"schema {schema}: applied {applied or 'nothing (up to date)'}")
            return 0
        nc = await _connect_nats(settings, f"tether-{action}")
        try:
            log = EventLog(nc, settings.subjects)
            options: dict[str, Any] = {"batch_size": batch_size, "preview_chars": settings.input_preview_chars,
                           "on_progress": _progress_printer(action)}
            if action == "rebuild":
                report = await rebuild(pool, log, schema, **options)
                print(file=sys.stderr)
                print(f"rebuilt {schema} from {report.events} events up to sequence "
                      f"{report.checkpoint} in {report.seconds:.2f}s "
                      f"({report.events / max(report.seconds, 1e-9):,.0f} events/s)")
                _print_digests(report.digests)
                return 0
            result = await verify(pool, log, schema, **options)
            print(file=sys.stderr)
            print(f"verified {schema} against a replay up to sequence {result.checkpoint}")
            _print_digests(result.live, result.replayed)
            if result.differences:
                print(f"DIFFERENT: {', '.join(result.differences)}", file=sys.stderr)
                return 1
            print("identical")
            return 0
        finally:
            await nc.drain()
    finally:
        await pool.close()


async def _connect_nats(settings: Settings, name: str):
    from tether.adapters.nats_connection import connect_nats

    failures: list[BaseException] = []

    async def keep(error: BaseException) -> None:
        failures.append(error)

    # nats-py tries the first connection again and again: bound it, keep the last reason.
    try:
        async with asyncio.timeout(NATS_CONNECT_TIMEOUT_S):
            return await connect_nats(settings.nats_connect_url, name=name,
                                      startup_timeout_s=None, error_cb=keep,
                                      fast_path=settings.nats_fast_path,
                                      **settings.nats_options())
    except TimeoutError:
        why = failures[-1] if failures else f"no answer within {NATS_CONNECT_TIMEOUT_S:g} s"
        raise CommandFailed(nats_unreachable(settings.nats_url, why)) from None


def _progress_printer(action: str) -> Callable[[int, int, float], None]:
    def show(seq: int, target: int, rate: float) -> None:
        done = seq / target if target else 1.0
        print(f"\r{action}: sequence {seq:,} of {target:,} ({done:.0%}), {rate:,.0f} events/s",
              end="", file=sys.stderr, flush=True)

    return show


def _print_digests(live: dict[str, tuple[int, str]],
                   replayed: dict[str, tuple[int, str]] | None = None) -> None:
    for table, (rows, digest) in live.items():
        line = f"  {table:<20} {rows:>9,} rows  md5 {digest}"
        if replayed is not None:
            other = replayed.get(table)
            line += "  ==" if other == (rows, digest) else f"  != replay {other}"
        print(line)


COMMANDS: tuple[Command, ...] = (
    Command("services", "run Tether services", _services_arguments,
            lambda args, settings: _in_loop(settings, _run_services(settings, args.name))),
    Command("projections", "manage the Postgres projections", _projections_arguments,
            lambda args, settings: _in_loop(settings, _projections(settings, args.action,
                                                                   args.batch_size))),
    *CLIENT_COMMANDS,
    RUNS,
    Command("ui", "serve the web timeline of parents and their runs", _ui_arguments, _ui),
    Command("gateway", "serve the child agents as MCP tools to the callers of "
                       "TETHER_GATEWAY_CALLERS_FILE", _gateway_arguments,
            lambda args, settings: _in_loop(settings, _run_services(settings, "gateway"))),
)
BY_NAME = {command.name: command for command in COMMANDS}


if __name__ == "__main__":
    sys.exit(main())
