"""The deliveries bucket (`adapters/deliveries.py`) as an application in a NATS account of
its own writes and reads it.

Such an application has no JetStream API (`tether.access`), yet its hook handler must
keep its own record of each delivery, so that a hook is not handled twice while the
parent service that writes the ledger is down. Its account imports exactly two things of
the bucket, both scoped by its parent agent: a put on its own keys
(`$KV.<bucket>.<agent>.>`, a plain publish the stream acknowledges) and a direct get of
the last value of one of them (`$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<agent>.>`,
which takes no body, so the key is the one in the subject).

A publish's headers are where no permission can see them, and the one header that
reaches past the key it is sent to is a rollup (`Nats-Rollup: all` empties the whole
bucket): the services keep the bucket refusing rollups (`open_to_tenants`). A put with
a message id of another tenant's choosing changes nothing either: the records are put
without one.
"""

import json

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from tether.adapters.deliveries import delivery_key, held_value, marked_delivered
from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef
from tether.ports import SYSTEM_CLOCK

REQUEST_TIMEOUT_S = 5.0
# JetStream's error code for a put whose expected last sequence is not the subject's.
WRONG_LAST_SEQUENCE = 10071


async def open_to_tenants(js: JetStreamContext, bucket: str) -> None:
    """Make the bucket's stream answer direct gets and refuse `Nats-Rollup` headers (a
    key-value bucket is made without the one and with the other, for purges, which no
    one makes of this one)."""
    info = await js.stream_info(f"KV_{bucket}")
    if info.config.allow_rollup_hdrs or not info.config.allow_direct:
        info.config.allow_rollup_hdrs = False
        info.config.allow_direct = True
        await js.update_stream(info.config)


class TenantDeliveryRecords:
    """`DeliveryRecords` over the two subjects an application's account imports."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self._nc = nc
        self._bucket = subjects.deliveries_bucket

    def _subject(self, parent: ParentRef, method: str, message_id: str) -> str:
        return f"$KV.{self._bucket}.{delivery_key(parent, method, message_id)}"

    async def recorded(self, parent: ParentRef, method: str, message_id: str) -> bool:
        """Whether the delivery is marked delivered."""
        subject = self._subject(parent, method, message_id)
        value, _ = await self._last(subject)
        return value is not None and marked_delivered(value, self._bucket, subject)

    async def mark_held(self, parent: ParentRef, method: str, message_id: str, status: str,
                        lease_ms: int) -> None:
        """Put the mark unless the delivery is recorded, compare-and-set on the key's last
        sequence (`DeliveryRecords.mark_held` says why)."""
        subject = self._subject(parent, method, message_id)
        value, revision = await self._last(subject)
        if value is not None and marked_delivered(value, self._bucket, subject):
            return
        try:
            await self._put(subject, held_value(status, message_id, lease_ms),
                            {"Nats-Expected-Last-Subject-Sequence": str(revision)})
        except APIError as error:
            if error.err_code != WRONG_LAST_SEQUENCE:
                raise  # else written since: a record, or another replica's mark

    async def _last(self, subject: str) -> tuple[bytes | None, int]:
        """The key's last value (None: none, or deleted) and its sequence (0: none)."""
        get = f"$JS.API.DIRECT.GET.KV_{self._bucket}.{subject}"
        try:
            reply = await self._nc.request(get, b"", timeout=REQUEST_TIMEOUT_S)
        except NoRespondersError:
            return None, 0  # services without the bucket: the ledger alone tells
        headers = reply.headers or {}
        status = headers.get("Status")
        if status == "404":
            return None, 0
        if status is not None:
            raise APIError(code=int(status), description=headers.get("Description", ""))
        revision = int(headers.get("Nats-Sequence", "0"))
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None, revision
        return reply.data, revision

    async def record(self, parent: ParentRef, method: str, message_id: str,
                     status: str) -> None:
        value = json.dumps({"state": "delivered", "status": status, "message_id": message_id,
                            "at": SYSTEM_CLOCK.now()}).encode()
        await self._put(self._subject(parent, method, message_id), value)

    async def _put(self, subject: str, value: bytes,
                   headers: dict[str, str] | None = None) -> None:
        reply = await self._nc.request(subject, value, timeout=REQUEST_TIMEOUT_S,
                                       headers=headers)
        ack = json.loads(reply.data or b"{}")
        if "error" in ack:
            APIError.from_error(ack["error"])  # raises the error's own type
