"""The faststream broker of a service's request/reply and control subjects.

Queries (inspect, list, has_run), the child-runners' cancel and inspect, and observability
are typed faststream handlers and publishers; the hot paths (the event log's appends, the
command and work pull consumers, the followers) stay on the service's nats-py connection.
faststream opens its own connection to the same server, as the same user, so its
subscriptions and their permissions are the service's.
"""

from collections.abc import Sequence
from typing import Any

from faststream.nats import NatsBroker
from faststream.nats.security import NatsCredentials, NatsNKey
from faststream.security import BaseSecurity

from tether.adapters.nats_connection import nats_servers
from tether.config import Settings


def control_broker(settings: Settings, name: str, *, middlewares: Sequence[Any] = (),
                   ) -> NatsBroker:
    """A broker for `settings`' NATS server that keeps reconnecting, like `connect_nats`.

    faststream's own message logging is off: each handler logs what it decides in the
    service's structured log, and a line per query would be noise.
    """
    return NatsBroker(nats_servers(settings.nats_connect_url), name=name, max_reconnect_attempts=-1,
                      # (seconds, passed on to nats-py, which takes a float)
                      reconnect_time_wait=0.5,  # type: ignore[arg-type]
                      connect_timeout=5, logger=None,
                      middlewares=tuple(middlewares), security=_security(settings))


def _security(settings: Settings) -> BaseSecurity | None:
    """The NKey, credentials and TLS of `settings`, as faststream takes them."""
    options = settings.nats_options()
    context = options.get("tls")
    if "user_credentials" in options:
        return NatsCredentials.from_file(options["user_credentials"], ssl_context=context)
    if "nkeys_seed" in options:
        return NatsNKey.from_file(options["nkeys_seed"], ssl_context=context)
    return BaseSecurity(ssl_context=context) if context is not None else None


async def start_control(broker: NatsBroker) -> None:
    """Start the handlers, and return once the server has their subscriptions: a request
    sent after this returns reaches them."""
    await broker.start()
    await broker.connection.flush()
