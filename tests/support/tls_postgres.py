"""A Postgres of a test's own that speaks TLS with a given certificate and takes its
client authentication from a given pg_hba.conf."""

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tls_postgres(devstack, cert: Path, key: Path, hba: str, *, database: str = "tether_tls",
                 role: str = "postgres", password: str | None = None) -> Iterator[str]:
    """Yields `postgresql://role[:password]@127.0.0.1:PORT/database` (no TLS parameters).
    The role (a superuser), its password and the database are made over the local
    socket, which `hba` must trust."""
    # Not under pytest's tmp_path: the postgres user must reach it.
    directory = Path(tempfile.mkdtemp(prefix="tether-pg-tls-"))
    directory.chmod(0o755)
    own_cert, own_key, own_hba = directory / "server.crt", directory / "server.key", \
        directory / "pg_hba.conf"
    shutil.copyfile(cert, own_cert)
    shutil.copyfile(key, own_key)
    own_hba.write_text(hba)
    user = devstack.pg_user()
    if user is not None:
        owner = pwd.getpwnam(user)
        for path in (own_cert, own_key, own_hba):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    own_key.chmod(0o600)
    port = devstack.free_port()
    data = directory / "data"
    proc, bindir = devstack.start_postgres(
        data, port, directory / "postgres.log", daemon=False,
        settings=("ssl=on", f"ssl_cert_file={own_cert}", f"ssl_key_file={own_key}",
                  f"hba_file={own_hba}"))
    try:
        socket = ["-h", str(data), "-p", str(port), "-U", "postgres"]
        statements = [] if role == "postgres" else [f'CREATE ROLE "{role}" LOGIN SUPERUSER']
        if password is not None:
            statements.append(f"ALTER ROLE \"{role}\" PASSWORD '{password}'")
        for statement in statements:
            subprocess.run([f"{bindir}/psql", *socket, "-d", "postgres", "-c", statement],
                           check=True, capture_output=True, **devstack.as_user(user))
        devstack.run_quiet([f"{bindir}/createdb", *socket, "-O", role, database], user=user)
        credentials = role if password is None else f"{role}:{password}"
        yield f"postgresql://{credentials}@127.0.0.1:{port}/{database}"
    finally:
        devstack.stop_pid(proc.pid, signal.SIGINT, "postgres")
        shutil.rmtree(directory, ignore_errors=True)
