"""Which server could not be reached: messages that name the server, its URL and the setting.

A connection error from a driver names an address at best (`ConnectionRefusedError:
[Errno 111]`); when a command fails with one, it asks each server it uses whether it
answers at all and reports the ones that do not.
"""

import errno
import socket
from urllib.parse import urlsplit, urlunsplit

from tether.config import Settings

PROBE_TIMEOUT_S = 1.0
_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "postgresql": 5432, "postgres": 5432}


def redact(url: str) -> str:
    """The URL without its password, fit for a message; each of a comma-separated list."""
    return ",".join(_redact_one(server.strip()) for server in url.split(","))


def _redact_one(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class CannotListen(Exception):
    """The UI cannot listen where it is told (its port taken, its host not this machine's);
    the message names the address and the setting to change."""


class StartupFailed(ConnectionError):
    """A dependency stayed unreachable for the whole start-up time, or refused this
    connection; the message names it, its URL (without a password) and the setting."""


def nats_unreachable(url: str, error: object) -> str:
    return (f"cannot connect to NATS at {redact(url)} (TETHER_NATS_URL or --nats-url): "
            f"{error}")


def nats_refused(url: str, error: object, credentials: str) -> str:
    return (f"NATS at {redact(url)} refused this connection's credentials ({credentials}): "
            f"{error}")


def postgres_unreachable(url: str, error: object) -> str:
    return (f"cannot connect to Postgres at {redact(url)} (TETHER_DATABASE_URL or "
            f"--database-url): {error}")


def refused(url: str) -> str | None:
    """Why a TCP connection to the URL's first host fails, or None when it connects."""
    parts = urlsplit(url.split(",")[0])
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
    except ValueError as error:
        return str(error)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__


def unreachable_servers(settings: Settings, *, nats: bool = True,
                        postgres: bool = True) -> list[str]:
    """A message for each of the command's servers that does not accept a connection."""
    found = []
    if nats and (why := refused(settings.nats_url)) is not None:
        found.append(nats_unreachable(settings.nats_url, why))
    if postgres and (why := refused(settings.database_url)) is not None:
        found.append(postgres_unreachable(settings.database_url, why))
    return found


def is_address_in_use(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno == errno.EADDRINUSE
