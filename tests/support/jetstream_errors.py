"""The JetStream API's server-side failures during a test session, for failing tests' reports.

A JetStream API call that fails on the server (a 5xx: a stream or consumer the server
could not create, a store it could not write) reaches the test as a bare `ServerError`
from whichever call made it. The server also announces every API call with its request
and response on `$JS.EVENT.ADVISORY.API`; this watch keeps the failed ones, so the report
of a failing test names the request the server refused and why.
"""

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import nats

ADVISORY_SUBJECT = "$JS.EVENT.ADVISORY.API"


@dataclass(frozen=True)
class ApiFailure:
    at: float  # time.monotonic() when it was seen
    subject: str
    request: str
    error: dict

    def __str__(self) -> str:
        return f"{self.subject} {self.request[:300]!r} -> {json.dumps(self.error)}"


class ServerErrorWatch:
    """Subscribes (on a thread and event loop of its own) to the API advisories of one
    server and keeps the responses with an error of code 500 or more."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._failures: list[ApiFailure] = []
        self._seen_one = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jetstream-errors", daemon=True)
        self._stopping: asyncio.Event | None = None
        self.subscribed = False

    def start(self, timeout_s: float = 5.0) -> "ServerErrorWatch":
        """Starts watching and waits up to `timeout_s` for the subscription to be in place:
        `subscribed` says whether it is (a watch that could not connect keeps nothing)."""
        self._thread.start()
        self._ready.wait(timeout_s)
        return self

    def since(self, started: float) -> list[ApiFailure]:
        with self._seen_one:
            return [failure for failure in self._failures if failure.at >= started]

    def wait_since(self, started: float, timeout_s: float) -> list[ApiFailure]:
        """`since(started)`, once it has one or after `timeout_s` (blocks: for a thread)."""
        with self._seen_one:
            self._seen_one.wait_for(lambda: self.since(started), timeout_s)
        return self.since(started)

    def stop(self) -> None:
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(5)

    def _run(self) -> None:
        self._loop.run_until_complete(self._watch())

    async def _watch(self) -> None:
        self._stopping = asyncio.Event()
        try:
            nc = await nats.connect(self._url, name="tether-tests-api-errors",
                                    connect_timeout=10, max_reconnect_attempts=-1,
                                    allow_reconnect=True)
        except Exception:  # noqa: BLE001 -- a diagnostic aid: no server, no watch
            self._ready.set()
            return
        await nc.subscribe(ADVISORY_SUBJECT, cb=self._seen)
        await nc.flush()
        self.subscribed = True
        self._ready.set()
        await self._stopping.wait()
        await nc.close()

    async def _seen(self, msg) -> None:
        try:
            advisory = json.loads(msg.data)
            error = json.loads(advisory.get("response") or "{}").get("error")
        except (ValueError, AttributeError):
            return
        if error and int(error.get("code", 0)) >= 500:
            failure = ApiFailure(time.monotonic(), advisory.get("subject", ""),
                                 advisory.get("request") or "", error)
            with self._seen_one:
                self._failures.append(failure)
                self._seen_one.notify_all()
