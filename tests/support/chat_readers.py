"""Two durable chat readers of one name, for the tests of a long handling; an
application in an account of its own whose durable chat readers the parent serves."""

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
from authorized_nats import ALICE, ALICE_PARENT, BOB, PASSWORDS, authorized_nats
from eventually import eventually
from service_processes import SUPPORT, ServiceProcess, support_path

from tether.adapters.streams import StreamSettings, ensure_streams
from tether.config import Settings
from tether.domain.events import ParentRef
from tether_services import parent as parent_service

ACK_WAIT_S = 0.6  # the readers' ack wait, for these tests (`chat_consumers.ACK_WAIT_S`)


async def held_while_the_other_waits(handling, waiting, renewals: list):
    """The first message of `handling`, held (being handled) while `waiting`, the other
    reader of the name, asks for one, until `renewals` counts six renewals (two ack
    waits): without them, `waiting` would have had the message by then. It must not."""
    async with asyncio.timeout(10):
        message = await anext(handling)
    other_got = asyncio.create_task(anext(waiting))
    try:
        await eventually(lambda: len(renewals) >= 6, timeout=20)
        assert not other_got.done(), other_got
    finally:
        other_got.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other_got
    return message


def as_user(settings: Settings, url: str, user: str, **changes) -> Settings:
    return Settings(**{**settings.model_dump(), "nats_url": url, "nats_user": user,
                       "nats_password": PASSWORDS[user], **changes})


@contextlib.asynccontextmanager
async def served_chat(directory: Path, devstack,
                      settings: Settings) -> AsyncIterator[tuple[Settings, nats.NATS]]:
    """A nats-server with alice's account and Tether's, and the parent service answering
    her queries: her settings (she reads `ALICE_PARENT`'s chat through the parent) and
    the admin's connection to Tether's account."""
    subjects = settings.subjects
    with authorized_nats(directory, devstack, subjects, [ALICE, BOB], PASSWORDS) as (url, _):
        admin = await nats.connect(url, user="admin", password=PASSWORDS["admin"])
        await ensure_streams(admin.jetstream(), subjects, StreamSettings())
        stop = asyncio.Event()
        service = asyncio.create_task(parent_service.serve(
            as_user(settings, url, "parent"), stop, {}))
        query = json.dumps({"run_id": "x", "parent": msgspec.to_builtins(ALICE_PARENT)})

        async def answered():
            with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
                return await admin.request(subjects.rpc_for("has_run", ALICE_PARENT),
                                           query.encode(), timeout=2)
            return None

        try:
            await eventually(answered, timeout=30)
            yield as_user(settings, url, "alice"), admin
        finally:
            stop.set()
            await asyncio.wait_for(service, 15)
            await admin.close()


class ChatReaderProcess(ServiceProcess):
    """tests/support/chat_reader_process.py, started once it holds its first message."""

    def __init__(self, settings: Settings, parent: ParentRef) -> None:
        user = {} if settings.nats_user is None else {
            "TETHER_NATS_USER": settings.nats_user, "TETHER_NATS_PASSWORD": PASSWORDS[
                settings.nats_user]}
        super().__init__("chat-reader", {
            **os.environ, "TETHER_NATS_URL": settings.nats_url, "TETHER_PREFIX": settings.prefix,
            **user, "CHAT_PARENT": f"{parent.agent}/{parent.name}",
            "CHAT_ACK_WAIT_S": str(ACK_WAIT_S), "PYTHONPATH": support_path()})

    async def start(self) -> "ChatReaderProcess":
        await self._spawn(sys.executable, str(SUPPORT / "chat_reader_process.py"))
        await self.logged("test.chat_got", timeout=30)
        return self
