"""A key per delivered finish hook, written by the application that handled it.

The run's delivery ledger (`run.finish_delivered`) is appended by the parent service
when the handler reports a delivery; while the parent is down that report waits in the
commands stream. So the handler also writes a key of its own here as soon as its
function returns: a republished or redelivered hook finds it and is acknowledged without
a call, and the reconciler does not republish a hook whose key is there (it records the
ledger entry itself instead). The key names the parent, the method and the hook's
message id without its retry suffix, so every publication of one outcome of one life
shares it.

While its function runs on, the handler keeps a mark of its own under that key (`held`,
with its lease): the mark is put once a call has run half a second and with each
renewal of the hook, before a call that is not the first (a redelivery, a retry's copy)
and when the function raised (the consumer retries it), and the delivered record
replaces it. A first call that ends sooner, most of them, writes no mark. The reconciler does not republish a
hook whose mark keeps being renewed (`delivery/handler_holds.py`): the consumer already
brings the hook back until it is acknowledged, and a copy would go to another replica
and call the function a second time while the first call is under way.
"""

import json
import re
from contextlib import suppress

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, Field, ValidationError

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


class HeldMark(BaseModel):
    """A handler's mark that it is calling a hook's function: `lease_ms`, its lease;
    `revision`, the bucket's revision of the mark (each renewal puts a new one)."""

    lease_ms: int = Field(gt=0)
    revision: int


def held_value(status: str, message_id: str, lease_ms: int) -> bytes:
    return json.dumps({"state": "held", "status": status, "message_id": message_id,
                       "lease_ms": lease_ms, "at": SYSTEM_CLOCK.now()}).encode()


def held_mark(value: bytes | None, revision: int | None) -> HeldMark | None:
    """The mark a record holds, or None: a delivered record, or one that cannot be read
    (`marked_delivered` says so)."""
    try:
        record = json.loads(value or b"{}")
        if not isinstance(record, dict) or record.get("state") != "held":
            return None
        return HeldMark(lease_ms=record.get("lease_ms"), revision=revision)
    except (ValueError, RecursionError, ValidationError):
        return None


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

    async def held(self, parent: ParentRef, method: str, message_id: str) -> HeldMark | None:
        """The mark of a handler calling the hook's function now, if the record is one."""
        if self._bucket is None:
            return None
        try:
            entry = await self._bucket.get(delivery_key(parent, method, message_id))
        except KeyNotFoundError:
            return None
        return held_mark(entry.value, entry.revision)

    async def mark_held(self, parent: ParentRef, method: str, message_id: str, status: str,
                        lease_ms: int) -> None:
        """Put the mark, unless the delivery is recorded: a handler that wakes from a pause
        mid-call must not put its mark over the record another replica made meanwhile
        (the reconciler would take the hook for undelivered). Compare-and-set on the
        key's revision, so a record put between the read and the mark wins."""
        if self._bucket is None:
            return
        key = delivery_key(parent, method, message_id)
        try:
            entry = await self._bucket.get(key)
        except KeyNotFoundError:  # no record, or a deleted one
            entry = None
        if entry is not None and marked_delivered(entry.value, self._name, key):
            return
        value = held_value(status, message_id, lease_ms)
        with suppress(KeyWrongLastSequenceError):  # written since: a record, or a mark
            if entry is None or entry.value is None:
                await self._bucket.create(key, value)
            else:
                await self._bucket.update(key, value, last=entry.revision)

    async def record(self, parent: ParentRef, method: str, message_id: str,
                     status: str) -> None:
        if self._bucket is None:
            return
        value = json.dumps({"state": "delivered", "status": status, "message_id": message_id,
                            "at": SYSTEM_CLOCK.now()}).encode()
        await self._bucket.put(delivery_key(parent, method, message_id), value)

