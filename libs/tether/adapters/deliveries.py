"""A key per delivered finish hook, written by the application that handled it.

The run's delivery ledger (`run.finish_delivered`) is appended by the parent service
when the handler reports a delivery; while the parent is down that report waits in the
commands stream. So the handler also writes a key of its own here as soon as its
function returns: a republished or redelivered hook finds it and is acknowledged without
a call, and the reconciler does not republish a hook whose key is there (it records the
ledger entry itself instead). The key names the parent, the method and the hook's
message id without its retry suffix, so every publication of one outcome of one life
shares it.
"""

import json
import re

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from tether.domain.events import ParentRef
from tether.log import get_logger
from tether.ports import SYSTEM_CLOCK

_RETRY_SUFFIX = re.compile(r":retry\d+$")


def delivery_key(parent: ParentRef, method: str, message_id: str) -> str:
    """`<agent>.<name>.<method>.<message id>`; ':' (allowed in identifiers, not in KV keys)
    becomes '=' (allowed in keys, not in identifiers), so the mapping is one to one."""
    base = _RETRY_SUFFIX.sub("", message_id)
    return ".".join(part.replace(":", "=") for part in (parent.agent, parent.name, method, base))


def marked_delivered(value: bytes | None, bucket: str, key: str) -> bool:
    """Whether a record says its hook was delivered. A record that cannot be read (not
    JSON, not an object: corrupted, or written by something else) counts as absent, with
    a warning: the hook is called again, which hooks are documented to bear (they are
    idempotent), and its record is then written afresh; refusing it would block the hook
    for ever."""
    try:
        record = json.loads(value or b"{}")
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the stack
        record = None
    if not isinstance(record, dict):
        get_logger().warning("deliveries.unreadable_record", bucket=bucket, key=key)
        return False
    return record.get("state") == "delivered"


class DeliveryRecords:
    def __init__(self, bucket: KeyValue | None, name: str = "") -> None:
        """`bucket` None: services that predate the bucket; only the ledger is consulted.
        `name`: the bucket's, for the log."""
        self._bucket = bucket
        self._name = name

    @classmethod
    async def open(cls, js: JetStreamContext, name: str) -> "DeliveryRecords":
        try:
            return cls(await js.key_value(name), name)
        except NotFoundError:
            return cls(None, name)

    @property
    def available(self) -> bool:
        return self._bucket is not None

    async def recorded(self, parent: ParentRef, method: str, message_id: str) -> bool:
        """Whether the delivery is marked delivered."""
        if self._bucket is None:
            return False
        key = delivery_key(parent, method, message_id)
        try:
            entry = await self._bucket.get(key)
        except KeyNotFoundError:
            return False
        return marked_delivered(entry.value, self._name, key)

    async def record(self, parent: ParentRef, method: str, message_id: str,
                     status: str) -> None:
        if self._bucket is None:
            return
        value = json.dumps({"state": "delivered", "status": status, "message_id": message_id,
                            "at": SYSTEM_CLOCK.now()}).encode()
        await self._bucket.put(delivery_key(parent, method, message_id), value)

