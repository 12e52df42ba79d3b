"""The JetStream adapters under the one name applications have imported them by.

Each concept has its own module: `streams` (the streams and buckets), `event_log` (the
log), `pull` (durable pull consumers), `requests` (routed request/reply), `denials`
(refused publishes) and `nats_connection` (connecting). Tether's own code imports from
those; this module re-exports what applications and scripts use.
"""

from tether.adapters.denials import PublishDenied
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import NatsUnreachable, connect_nats
from tether.adapters.streams import StreamSettings, ensure_streams, key_value, remove_streams
from tether.ports import ConcurrencyConflict, RunHistory, StoredEvent

__all__ = [
    "ConcurrencyConflict",
    "EventLog",
    "NatsUnreachable",
    "PublishDenied",
    "RunHistory",
    "StoredEvent",
    "StreamSettings",
    "connect_nats",
    "ensure_streams",
    "key_value",
    "remove_streams",
]
