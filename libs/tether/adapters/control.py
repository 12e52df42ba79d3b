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

from tether.adapters.jetstream import nats_servers
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
                      middlewares=tuple(middlewares))


async def start_control(broker: NatsBroker) -> None:
    """Start the handlers, and return once the server has their subscriptions: a request
    sent after this returns reaches them."""
    await broker.start()
    await broker.connection.flush()
