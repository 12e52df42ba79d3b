"""The chaos scenarios' own servers: nats-server(s) and a Postgres cluster to stop,
kill, pause, partition and restart (the suite's shared ones are never touched)."""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _devstack():
    spec = importlib.util.spec_from_file_location("tether_devstack_chaos",
                                                  ROOT / "scripts" / "devstack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


devstack = _devstack()


@dataclass
class NatsNode:
    name: str
    port: int
    monitor: int
    cluster_port: int | None
    store: Path
    log: Path
    proc: subprocess.Popen | None = None


class Nats:
    """One nats-server, or a cluster of three with JetStream on each (R3 streams).

    `partitionable`: the third node runs in a network namespace of its own, joined to
    the others by a veth pair, so that a test can cut it off (`partition`) and join it
    again (`heal`) while it keeps running. The services connect to the other two.
    """

    def __init__(self, root: Path, nodes: int = 1, *, partitionable: bool = False) -> None:
        free = devstack.free_port
        self.nodes = [NatsNode(f"n{i}", free(), free(), free() if nodes > 1 else None,
                               root / f"nats-{i}", root / f"nats-{i}.log") for i in range(nodes)]
        self.net: Netns | None = Netns() if partitionable else None

    def host_of(self, node: NatsNode) -> str:
        if self.net is None:
            return "127.0.0.1"
        return self.net.inside if node is self.nodes[-1] else self.net.outside

    @property
    def url(self) -> str:
        reachable = self.nodes[:-1] if self.net is not None else self.nodes
        return ",".join(f"nats://127.0.0.1:{node.port}" for node in reachable)

    def start(self, index: int | None = None) -> None:
        if self.net is not None:
            self.net.create()
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.store.mkdir(parents=True, exist_ok=True)
            inside = self.net is not None and node is self.nodes[-1]
            client_host = self.net.inside if inside else "127.0.0.1"
            cmd = [devstack.find_nats_server(), "-a", client_host, "-p", str(node.port),
                   "-m", str(node.monitor), "-js", "-sd", str(node.store), "-n", node.name]
            if inside:
                cmd = ["ip", "netns", "exec", self.net.name, *cmd]
            if node.cluster_port is not None:
                routes = ",".join(f"nats://{self.host_of(other)}:{other.cluster_port}"
                                  for other in self.nodes if other is not node)
                cmd += ["--cluster_name", "chaos", "--cluster",
                        f"nats://{self.host_of(node)}:{node.cluster_port}", "--routes", routes]
            node.proc = devstack.spawn(cmd, node.log, parent_death_signal=signal.SIGKILL,
                                       extra_env={"GOMAXPROCS": "1"})
        for node in self.nodes if index is None else [self.nodes[index]]:
            self._wait_healthy(node)

    def partition(self) -> None:
        assert self.net is not None
        self.net.link(up=False)

    def heal(self) -> None:
        assert self.net is not None
        self.net.link(up=True)

    def _wait_healthy(self, node: NatsNode) -> None:
        monitor_host = self.net.inside if self.net is not None and node is self.nodes[-1] \
            else "127.0.0.1"
        url = f"http://{monitor_host}:{node.monitor}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=1) as r:
                if json.load(r).get("status") == "ok":
                    return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server {node.name} not healthy:\n{devstack.log_tail(node.log)}")

    def stop(self, index: int = 0, sig: int = signal.SIGTERM) -> None:
        node = self.nodes[index]
        assert node.proc is not None
        node.proc.send_signal(sig)
        node.proc.wait(timeout=30)
        node.proc = None

    def leader_of(self, stream: str) -> int:
        """The index of the node leading `stream` (from a node's monitoring endpoint)."""
        for node in self.nodes:
            if node.proc is None:
                continue
            if self.net is not None and node is self.nodes[-1]:
                continue  # cut off, perhaps: the others know who leads
            url = f"http://127.0.0.1:{node.monitor}/jsz?streams=true"
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=2) as r:
                for account in json.load(r).get("account_details", []):
                    for detail in account.get("stream_detail", []):
                        if detail["name"] == stream and detail.get("cluster", {}).get("leader"):
                            leader = detail["cluster"]["leader"]
                            return next(i for i, n in enumerate(self.nodes) if n.name == leader)
        raise RuntimeError(f"no leader found for {stream}")

    def close(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                with contextlib.suppress(Exception):
                    node.proc.kill()
                    node.proc.wait(timeout=10)
        if self.net is not None:
            self.net.remove()


class Netns:
    """A network namespace of the test's own, joined to this one by a veth pair on a
    /30 of 10.213.0.0/16 (addresses of these test hosts only)."""

    def __init__(self) -> None:
        tag = os.urandom(3).hex()
        self.name, self._host_if, self._inner_if = f"tch{tag}", f"vh{tag}", f"vn{tag}"
        block = int(tag, 16) % 16_000 * 4  # a /30 inside 10.213.0.0/16
        base = f"10.213.{block // 256}.{block % 256}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.outside, self.inside = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
        self.created = False

    def create(self) -> None:
        if self.created:
            return
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self._host_if, "type", "veth", "peer", "name",
                     self._inner_if],
                    ["ip", "link", "set", self._inner_if, "netns", self.name],
                    ["ip", "addr", "add", f"{self.outside}/30", "dev", self._host_if],
                    ["ip", "link", "set", self._host_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.inside}/30",
                     "dev", self._inner_if],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", self._inner_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        self.created = True

    def link(self, *, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self._host_if, "up" if up else "down"], check=True,
                       capture_output=True)

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self._host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)


def namespaces_available() -> str | None:
    """None when this machine lets the tests make network namespaces; else why not."""
    probe = Netns()
    try:
        probe.create()
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return f"network namespaces are not available here: {error} {detail.decode().strip()}"
    finally:
        probe.remove()
    return None


class Postgres:
    def __init__(self, root: Path) -> None:
        self.data = root / "pg"
        self.log = root / "pg.log"
        self.port = devstack.free_port()
        self.proc: subprocess.Popen | None = None
        self.bindir = ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/chaos"

    def start(self) -> None:
        self.proc, self.bindir = devstack.start_postgres(self.data, self.port, self.log,
                                                         daemon=False)
        devstack.create_database(self.bindir, self.port, "chaos")

    def stop(self, mode: str = "fast") -> None:
        """`pg_ctl stop -m fast` (SIGINT) or `-m immediate` (SIGQUIT)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT if mode == "fast" else signal.SIGQUIT)
        self.proc.wait(timeout=30)
        self.proc = None

    def postmaster_pid(self) -> int:
        """From the cluster's own `postmaster.pid` (its first line), checked against the
        process this harness started."""
        pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
        assert self.proc is not None and pid == self.proc.pid, (pid, self.proc)
        return pid

    def stop_all(self) -> list[int]:
        """SIGSTOP the postmaster, then every process it forked (its backends and
        auxiliary processes; stopped first, it forks no more meanwhile). Returns them."""
        postmaster = self.postmaster_pid()
        os.kill(postmaster, signal.SIGSTOP)
        children = _children_of(postmaster)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return [postmaster, *children]

    @staticmethod
    def continue_all(pids: list[int]) -> None:
        for pid in reversed(pids):  # the postmaster last, as it was stopped first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                # Stopped processes would leave SIGQUIT pending.
                self.continue_all([self.proc.pid, *_children_of(self.proc.pid)])
                self.proc.send_signal(signal.SIGQUIT)
                self.proc.wait(timeout=10)


def _children_of(parent: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:  # fields: state, ppid, ...
                children.append(int(stat.parent.name))
    return children
