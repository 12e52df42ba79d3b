"""A key per finish hook, written by the application that handles it.

The run's delivery ledger (`run.finish_delivered`) is appended by the parent service
when the handler reports a delivery; while the parent is down that report waits in the
commands stream. So the handler keeps a key of its own here: it *claims* the delivery
(an atomic create) before calling the function, and marks it *delivered* when the
function returns. A republished or redelivered hook finds the key: delivered, it is
acknowledged without a call; claimed a moment ago, it waits (another handler is calling
the function now); claimed longer ago than the lease, its handler died mid-call and the
claim is taken over. The reconciler does not republish a hook whose key says delivered
(it records the ledger entry itself instead). The key names the parent, the method and
the hook's message id without its retry suffix, so every publication of one outcome of
one life shares it.
"""

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from tether.domain.events import ParentRef

_RETRY_SUFFIX = re.compile(r":retry\d+$")


def delivery_key(parent: ParentRef, method: str, message_id: str) -> str:
    """`<agent>.<name>.<method>.<message id>`; ':' (allowed in identifiers, not in KV keys)
    becomes '=' (allowed in keys, not in identifiers), so the mapping is one to one."""
    base = _RETRY_SUFFIX.sub("", message_id)
    return ".".join(part.replace(":", "=") for part in (parent.agent, parent.name, method, base))


class DeliveryRecords:
    def __init__(self, bucket: KeyValue | None) -> None:
        """`bucket` None: services that predate the bucket; only the ledger is consulted."""
        self._bucket = bucket

    @classmethod
    async def open(cls, js: JetStreamContext, name: str) -> "DeliveryRecords":
        try:
            return cls(await js.key_value(name))
        except NotFoundError:
            return cls(None)

    @property
    def available(self) -> bool:
        return self._bucket is not None

    async def claim(self, parent: ParentRef, method: str, message_id: str,
                    lease_s: float, token: str | None = None) -> "Claim":
        """Claim the delivery before calling the function (see the module docstring).
        Safe to retry: a claim of ours that landed before its answer was lost is ours."""
        if self._bucket is None:
            return Claim("claimed", "", 0)
        key = delivery_key(parent, method, message_id)
        token = token or uuid.uuid4().hex
        claimed = json.dumps({"state": "claimed", "token": token, "at": _now_ms()}).encode()
        try:
            return Claim("claimed", key, await self._bucket.create(key, claimed), token)
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._bucket.get(key)
        except KeyNotFoundError:  # deleted (expired) between the two: claim it again
            return Claim("claimed", key, await self._bucket.put(key, claimed), token)
        value = json.loads(entry.value or b"{}")
        if value.get("state") == "delivered":
            return Claim("delivered", key, entry.revision)
        if value.get("token") == token:  # an earlier try of this claim landed
            return Claim("claimed", key, entry.revision, token)
        if _now_ms() - int(value.get("at", 0)) < lease_s * 1000:
            return Claim("busy", key, entry.revision)
        # The claimer did not finish within the lease: it died, or its call hangs.
        try:
            return Claim("claimed", key, await self._bucket.update(key, claimed,
                                                                   last=entry.revision), token)
        except KeyWrongLastSequenceError:
            return Claim("busy", key, entry.revision)  # another handler took it over first

    async def recorded(self, parent: ParentRef, method: str, message_id: str) -> bool:
        """Whether the delivery is marked delivered."""
        if self._bucket is None:
            return False
        try:
            entry = await self._bucket.get(delivery_key(parent, method, message_id))
        except KeyNotFoundError:
            return False
        return json.loads(entry.value or b"{}").get("state") == "delivered"

    async def mark_delivered(self, claim: "Claim", status: str, message_id: str) -> None:
        if self._bucket is None or not claim.key:
            return
        value = json.dumps({"state": "delivered", "status": status, "message_id": message_id,
                            "at": _now_ms()}).encode()
        await self._bucket.put(claim.key, value)


@dataclass(frozen=True, slots=True)
class Claim:
    state: Literal["claimed", "delivered", "busy"]
    key: str
    revision: int
    token: str = ""


def _now_ms() -> int:
    return int(time.time() * 1000)
