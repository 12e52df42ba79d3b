"""A nats-server of a test's own with the accounts and users `tether.access` generates."""

import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tether.access import USERS, Application, render
from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef

# Two tenants, each owning one parent agent with one hook method, and every user's password.
ALICE = Application("alice", ("AliceBot",), ("on_done",))
BOB = Application("bob", ("BobBot",), ("on_done",))
ALICE_PARENT = ParentRef(agent="AliceBot", name="user-1")
BOB_PARENT = ParentRef(agent="BobBot", name="user-1")
PASSWORDS = {user: f"{user}-secret" for user in (*USERS, "alice", "bob")}


@contextlib.contextmanager
def nats_server(directory: Path, devstack, body: str, *, listen: str = "",
                scheme: str = "nats") -> Iterator[tuple[str, Path]]:
    """nats-server with JetStream and the configuration `body`; yields its URL and its
    log's path, and stops it on exit."""
    port, monitor = devstack.free_port(), devstack.free_port()
    config = directory / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
                      f"jetstream {{ store_dir: {json.dumps(str(directory / 'js'))} }}\n"
                      + listen + body)
    with running_nats_server(devstack, config, monitor) as log_path:
        yield f"{scheme}://127.0.0.1:{port}", log_path


@contextlib.contextmanager
def running_nats_server(devstack, config: Path, monitor: int,
                        env: dict[str, str] | None = None) -> Iterator[Path]:
    """nats-server -c `config` (logging beside it), once its monitoring port on `monitor`
    says JetStream is up; yields the log's path, and stops it on exit."""
    log_path = config.parent / "nats.log"
    with log_path.open("wb") as out:
        server = subprocess.Popen([devstack.find_nats_server(), "-c", str(config)],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=1):
                break
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        yield log_path
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextlib.contextmanager
def authorized_nats(directory: Path, devstack, subjects: Subjects,
                    applications: list[Application],
                    passwords: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """nats-server with JetStream and the accounts of the services, the operators and
    `applications`; yields its URL and its log's path, and stops it on exit."""
    with nats_server(directory, devstack,
                     render(subjects, applications, passwords=passwords)) as server:
        yield server
