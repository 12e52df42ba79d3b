"""A2A push notifications, durable: each config a caller sets on a task is kept in Postgres
(`tether.adapters.postgres.push_configs`), and the gateway that holds it POSTs the task to
its URL at each change of the task's state, until a final state has been taken.

A notification is the task as `GetTask` would answer then, as A2A's `StreamResponse`
JSON (`{"task": {...}}`), with the config's token in `X-A2A-Notification-Token`, its
authentication in `Authorization`, and `X-Tether-Notification-Id`: the same id each time
the same notification is sent again, so a receiver can drop repeats. It is written into
the config's outbox before it is sent, and sent again (backing off up to a minute) until
the receiver answers 2xx: at least once, through a receiver that is down, a gateway that
restarts or a replica that dies (another takes its configs once their lease runs out,
`TETHER_GATEWAY_PUSH_LEASE_MS`).

A gateway sends for a config only while it surely holds it: its lease counts as fresh
for two thirds of its length after the claim that renewed it was sent (this process's
monotonic clock, which a pause does not stop), and a stale one is renewed in Postgres
before the next send. A gateway paused past its lease, whose config another took over,
sends nothing more for it when it wakes, and its writes of the config's progress are
refused (`push.taken_over`).
"""

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import asyncpg
import httpx
from a2a.types import StreamResponse, TaskPushNotificationConfig, TaskState
from a2a.utils.errors import InvalidParamsError
from a2a.utils.push_url_validator import validate_push_notification_url
from google.protobuf.json_format import MessageToDict

from tether.adapters.postgres.push_configs import PushConfig, PushConfigs
from tether.client.parent import ParentHandle
from tether.domain import lease
from tether.domain.ids import InvalidIdentifier, check_identifier
from tether.gateway.a2a_tasks import FINAL, a2a_state, task_of, view_state
from tether.gateway.callers import Callers
from tether.resilience import Backoff, sleep_unless_stopped

NOTIFICATION_ID_HEADER = "X-Tether-Notification-Id"
# What no retry mends: a request httpx will not build (a header or URL it refuses).
NEVER_SENDABLE = (httpx.LocalProtocolError, httpx.InvalidURL, httpx.UnsupportedProtocol)
CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
HOST = re.compile(r"[A-Za-z0-9._~-]+|[0-9A-Fa-f:.]+")
T = TypeVar("T")
FRESH_SHARE = 2 / 3  # of the lease: how long after its renewal a gateway acts on it


class TakenOver(Exception):
    """Another gateway holds the config now: this one lost it (it was paused, or cut off
    from Postgres, past its lease)."""


class Pusher:
    """Claims the configs nobody holds, and follows each one's task, sending what it owes."""

    def __init__(self, store: PushConfigs, callers: Callers,
                 parent_of: Callable[[Any], ParentHandle], logger, *, owner: str,
                 http: httpx.AsyncClient, lease_s: float = 15.0, scan_s: float = 1.0) -> None:
        self.store, self.callers, self.parent_of, self.logger = store, callers, parent_of, logger
        self.owner, self.http, self.lease_s, self.scan_s = owner, http, lease_s, scan_s
        self.wake = asyncio.Event()  # a config was added: look at once
        self._following: dict[tuple[str, str, str], asyncio.Task] = {}
        # When the last claim or renewal that held each config was sent (monotonic).
        self._renewed: dict[tuple[str, str, str], float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    sent = time.monotonic()
                    for config in await self.store.claim(self.owner, self.lease_s, limit=1000):
                        self._renewed[config.key] = sent
                        if config.key not in self._following:
                            self._following[config.key] = asyncio.create_task(
                                self._follow(config, stop))
                except (OSError, asyncpg.PostgresError) as error:
                    self.logger.warning("push.claim_failed",
                                        error=f"{type(error).__name__}: {error}",
                                        detail=f"tried again in {self.scan_s:g}s")
                for key, task in list(self._following.items()):
                    if task.done():
                        del self._following[key]
                        self._renewed.pop(key, None)
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.scan_s):
                        await _first(self.wake.wait(), stop.wait())
        finally:
            for task in self._following.values():
                task.cancel()
            await asyncio.gather(*self._following.values(), return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.store.release(self.owner)

    async def _follow(self, config: PushConfig, stop: asyncio.Event) -> None:
        try:
            await self._deliver(config, stop)
        except TakenOver:
            self.logger.info("push.taken_over", task_id=config.task_id,
                             config_id=config.config_id,
                             detail="another gateway holds the config since this one's "
                                    "lease ran out: it sends the task's notifications")
        except Exception as error:  # noqa: BLE001 - the next scan takes the config up again
            self.logger.warning("push.interrupted", task_id=config.task_id,
                                config_id=config.config_id,
                                error=f"{type(error).__name__}: {error}",
                                detail=f"taken up again within {self.scan_s:g}s")

    async def _deliver(self, config: PushConfig, stop: asyncio.Event) -> None:
        """Send what `config` owes, then each change of its task's state, to the end."""
        caller = self.callers.by_name(config.caller)
        if caller is None:
            self._held(await self.store.finish(
                self.owner, config, f"caller {config.caller!r} is no longer in the callers "
                                    "file"))
            return
        parent = self.parent_of(caller)
        while not config.done and not stop.is_set():
            if config.pending_id is not None:
                config = await self._send(config, stop)
                continue
            snapshot = await parent.inspect(config.task_id)
            if snapshot is None:
                self._held(await self.store.finish(self.owner, config,
                                                   f"task {config.task_id} is gone"))
                return
            state = a2a_state(snapshot)
            if TaskState.Name(state) != config.sent_state:
                body = MessageToDict(StreamResponse(task=task_of(snapshot)))
                config = self._held(await self.store.owe(self.owner, config,
                                                         TaskState.Name(state), body))
                continue
            await self._until_moved(parent, config.task_id, state, stop)

    @staticmethod
    def _held(written: T | None) -> T:
        """What a write of the config's progress returned; `TakenOver` when it was
        refused (None or False: another gateway holds the config)."""
        if written is None or written is False:
            raise TakenOver()
        return written

    async def _ensure_held(self, config: PushConfig) -> None:
        """Before a send: at once while the lease is fresh; else renewed in Postgres
        first (`TakenOver` when another gateway holds it)."""
        renewed = self._renewed.get(config.key)
        if lease.fresh(time.monotonic(), renewed, self.lease_s * FRESH_SHARE):
            return
        sent = time.monotonic()
        self._held(await self.store.renew(self.owner, config, self.lease_s))
        self._renewed[config.key] = sent

    async def _until_moved(self, parent: ParentHandle, task_id: str, state: int,
                           stop: asyncio.Event) -> None:
        views = parent.timeline(run_id=task_id)
        async with contextlib.aclosing(views):
            watching = asyncio.ensure_future(_moved(views, task_id, state))
            await _first(watching, stop.wait())

    async def _send(self, config: PushConfig, stop: asyncio.Event) -> PushConfig:
        """POST the owed notification until the receiver takes it."""
        assert config.pending_id is not None and config.pending_state is not None
        headers = {NOTIFICATION_ID_HEADER: config.pending_id}
        if config.token:
            headers["X-A2A-Notification-Token"] = config.token
        if config.auth_scheme and config.auth_credentials:
            headers["Authorization"] = f"{config.auth_scheme} {config.auth_credentials}"
        backoff = Backoff(initial_s=0.2, max_s=60.0)
        while True:
            await self._ensure_held(config)
            try:
                response = await self.http.post(config.url, json=config.pending_body,
                                                 headers=headers)
                response.raise_for_status()
            except NEVER_SENDABLE as error:
                # Sent again, it fails again: the config is finished with the reason.
                why = (f"{type(error).__name__}: {error}: the config can never be sent; "
                       "set it again with a valid URL, token and credentials")
                self._held(await self.store.finish(self.owner, config, why))
                self.logger.warning("push.abandoned", task_id=config.task_id,
                                    config_id=config.config_id, url=config.url, error=why)
                return dataclasses.replace(config, done=True)
            except httpx.HTTPError as error:
                why = f"{type(error).__name__}: {error}"
                self._held(await self.store.failed(self.owner, config, why))
                if backoff.failures == 0:
                    self.logger.warning("push.failed", task_id=config.task_id,
                                        config_id=config.config_id, url=config.url,
                                        error=why, detail="sent again until it is taken")
                if await sleep_unless_stopped(stop, backoff.next_delay()):
                    return config
                continue
            final = TaskState.Value(config.pending_state) in FINAL
            self.logger.info("push.sent", task_id=config.task_id, config_id=config.config_id,
                             state=config.pending_state, notification_id=config.pending_id)
            return self._held(await self.store.sent(self.owner, config, final))


async def _moved(views, task_id: str, state: int) -> None:
    async for view in views:
        run = view.runs.get(task_id)
        if run is not None and view_state(run) != state:
            return


async def _first(*awaitables) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Pushes:
    """What the A2A handlers do with push configs: kept for the caller's tasks only, a URL
    checked before it is kept, the pusher woken for a new one."""

    def __init__(self, store: PushConfigs, pusher: Pusher, *, private_urls: bool) -> None:
        self.store, self.pusher, self.private_urls = store, pusher, private_urls

    async def set(self, caller: str, config: TaskPushNotificationConfig
                  ) -> TaskPushNotificationConfig:
        await self.check(config)
        config_id = config.id or "default"
        await self.store.put(PushConfig(
            caller=caller, task_id=config.task_id, config_id=config_id, url=config.url,
            token=config.token, auth_scheme=config.authentication.scheme,
            auth_credentials=config.authentication.credentials))
        self.pusher.wake.set()
        return _proto(await self.store.get(caller, config.task_id, config_id))

    async def get(self, caller: str, task_id: str, config_id: str
                  ) -> TaskPushNotificationConfig | None:
        found = await self.store.get(caller, task_id, config_id or "default")
        return None if found is None else _proto(found)

    async def of_task(self, caller: str, task_id: str) -> list[TaskPushNotificationConfig]:
        return [_proto(config) for config in await self.store.of_task(caller, task_id)]

    async def delete(self, caller: str, task_id: str, config_id: str) -> bool:
        return await self.store.delete(caller, task_id, config_id or "default")

    async def check(self, config: TaskPushNotificationConfig) -> None:
        """Refuse a config that could never be sent (`InvalidParamsError`, naming the
        field), rather than keep it and retry it for ever."""
        await self.check_url(config.url)
        try:  # it goes into a header: `X-Tether-Notification-Id`
            check_identifier(config.id or "default", "id (the push notification config's)")
        except InvalidIdentifier as error:
            raise InvalidParamsError(message=str(error)) from None
        for name, value in (("token", config.token),
                            ("authentication.scheme", config.authentication.scheme),
                            ("authentication.credentials", config.authentication.credentials)):
            if CONTROL.search(value):
                raise InvalidParamsError(message=f"{name}: holds a control character (a "
                                                 "header cannot carry it)")

    async def check_url(self, url: str) -> None:
        why = url_problem(url)
        if why is not None:
            raise InvalidParamsError(message=f"url: {why}")
        if not self.private_urls and not await validate_push_notification_url(url):
            raise InvalidParamsError(
                message=f"url: {url} is not reachable from here or is a private, loopback "
                        "or link-local address, which the gateway does not call unless "
                        "TETHER_GATEWAY_PUSH_PRIVATE_URLS is set")


def url_problem(url: str) -> str | None:
    """Why a push notification URL can never be sent to (None: it can be tried)."""
    if CONTROL_OR_SPACE.search(url):
        return f"{url!r} holds a space or a control character"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        return f"{url!r} is not a URL ({error})"
    if parsed.scheme not in ("http", "https"):
        return f"a push notification URL is http(s), not {url!r}"
    host = parsed.host
    if not host or HOST.fullmatch(host) is None:
        return f"{url!r} names no valid host"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"{url!r} has port {parsed.port}, outside 1..65535"
    return None


def _proto(config: PushConfig | None) -> TaskPushNotificationConfig:
    assert config is not None
    proto = TaskPushNotificationConfig(id=config.config_id, task_id=config.task_id,
                                       url=config.url, token=config.token)
    if config.auth_scheme:
        proto.authentication.scheme = config.auth_scheme
        proto.authentication.credentials = config.auth_credentials
    return proto
