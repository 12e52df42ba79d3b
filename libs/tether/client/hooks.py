"""Finish hooks of detached runs, delivered to the application that owns the parent.

The parent publishes a `HookMessage` to `<prefix>.hook.<parent_agent>.<method>` when a
detached run with `on_finish: method` ends (and to `on_agent_tool_finish` for every
detached run of a parent agent whose application registered a global handler). A handler
registers each method in the registry bucket, so the parent accepts runs that name it,
and consumes each method's subject with a durable pull consumer shared by its replicas.

Delivery: exactly once normally, at least once on a crash. After the function returns,
the handler writes its own record of the delivery (a key in the deliveries bucket,
`adapters/deliveries.py`), then the delivery goes in the run's ledger (the parent service
records it on the handler's `delivered` command, which reports together the deliveries
finished within a few milliseconds of each other: one `run.finish_delivered` on the run,
or, for several, one `deliveries.recorded` on the parent agent's ledger subject), and
only then the message is acknowledged. A message whose delivery is already
recorded (this handler's memory of the calls it made, the key, or the ledger) is
acknowledged without calling the function, and one whose delivery this handler is making
right now waits, so a redelivery after a lost ack, a republished hook, a broker that
forgot a delivery in a restart, or a crash between the steps does not call it again, even
while the parent service that writes the ledger is down. The key is read for every
message; the ledger for every message that could repeat an earlier one: a redelivery, or
a publication the parent does not mark as its first for the outcome
(`Tether-First-Publication`). A function that raises is retried after
the lease (`hook_lease_ms`) and never dropped (`max_deliver` -1). A call that outlasts a
third of the lease renews it until the hook is acknowledged, and its mark in the
deliveries bucket with it (put too before a call that is not the hook's first, and when
the function raised), so the reconciler publishes no copy for another replica meanwhile; a plain function runs in a worker thread, so one that
blocks stops no renewal. A process that dies (or is paused past the lease) mid-call
leaves the message to be redelivered when the lease runs out, and one woken past the
lease before its call leaves it too (`Hold`); one that gets the message back while it is
still handling it goes on with that delivery (`HeldHook`). Handlers must
still be idempotent: a crash after the function and before the ledger calls it again.
"""

import asyncio
import inspect
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, get_args

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from tether import tracing
from tether.adapters.deliveries import DeliveryRecords, delivery_key
from tether.adapters.denials import PublishDenied, unless_refused
from tether.adapters.holds import Hold, StallWatch
from tether.adapters.hook_consumers import (
    consumer_config,
    consumer_name,
    registration,
    registry_key,
)
from tether.adapters.pull import Delivery, Pull, delivery_of, durable_pull
from tether.adapters.tenant_deliveries import TenantDeliveryRecords
from tether.client.errors import NotPermitted, ServiceUnavailable
from tether.client.hook_calls import (
    DeliveryReports,
    HeldHook,
    HookFunction,
    RecentKeys,
    call_hook,
)
from tether.client.link import Link
from tether.contract.messages import (
    FIRST_PUBLICATION_HEADER,
    HookMessage,
    RunInfo,
    ServeHookReply,
)
from tether.domain.commands import DeliveredCommand, DeliveryReport, ServeHookQuery
from tether.domain.decide import record_delivery_of_this_life
from tether.domain.ids import (
    GLOBAL_FINISH_HOOK,
    check_identifier,
    names_this_life,
    unknown_life_finish_id,
)
from tether.log import get_logger
from tether.ports import SYSTEM_CLOCK
from tether.resilience import (
    TRANSIENT_ERRORS,
    Backoff,
    Health,
    Persisting,
    describe,
    is_transient,
    settle,
    sleep_unless_stopped,
)

FETCH_WAIT_S = 0.5
# How many deliveries a handler remembers having made: a copy of one of them (a broker
# that forgot the acknowledgement, a republication) is acknowledged without a look at the
# records.
CALLED_KEPT = 10_000
# A hook's first call still running this long after it started is marked in the
# deliveries bucket (a shorter call writes no mark: most of them).
FIRST_MARK_AFTER_S = 0.5
# The shortest lease a handler takes, as the setting (`hook_lease_ms`) does.
MIN_LEASE_MS = 100
Ledger = Literal["parent", "direct"]


@dataclass(slots=True)
class HookStats:
    called: int = 0  # the function returned
    failed: int = 0  # the function raised; retried after the lease
    skipped: int = 0  # already in the ledger: acknowledged without a call
    malformed: int = 0  # not a HookMessage: terminated, never retried
    deferred: int = 0  # another handler was calling the function: put back for later
    left: int = 0  # held past the lease (this process was paused): left to its redelivery
    renewed: int = 0  # in-progress acknowledgements of calls that outlasted a third of the lease


def _lease_ms(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} is a number of milliseconds, not {type(value).__name__}")
    if not (math.isfinite(value) and value >= MIN_LEASE_MS):
        raise ValueError(f"{name} must be at least {MIN_LEASE_MS} milliseconds (how long a "
                         f"hook is held before it is delivered again), not {value!r}")
    return value


def _check_takes_run_and_result(method: str, function: HookFunction) -> None:
    """A hook is called with two positional arguments, `(run, result)`: a function that
    cannot take them is refused here, not failed on every delivery."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): its first call will say
    try:
        signature.bind(None, None)
    except TypeError as error:
        raise TypeError(f"the {method} hook must take two positional arguments (run, result) "
                        f"and no other required ones; {getattr(function, '__qualname__', function)}"
                        f"{signature} does not: {error}") from None


class HookRegistry:
    def __init__(self, tether: Link, parent_agent: str, *, lease_ms: int | None = None,
                 concurrency: int = 8, ledger: Ledger = "parent") -> None:
        """`ledger`: who records `run.finish_delivered` — the parent service, asked with
        `<prefix>.cmd.delivered.<agent>.<name>` (the default, and the only way under the
        shipped access control, where applications may not append events), or this
        process directly ("direct": for tests and setups without a parent service)."""
        self.tether = tether
        if ledger not in get_args(Ledger):
            raise ValueError(f"ledger must be 'parent' or 'direct', not {ledger!r}")
        self.ledger = ledger
        self.parent_agent = check_identifier(parent_agent, "parent agent")
        if lease_ms is None:
            self.lease_s = _lease_ms(tether.settings.hook_lease_ms,
                                     "hook_lease_ms (TETHER_HOOK_LEASE_MS)") / 1000
        else:
            self.lease_s = _lease_ms(lease_ms, "lease_ms") / 1000
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency is an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.concurrency = concurrency
        self.functions: dict[str, HookFunction] = {}
        self.stats = HookStats()
        self.ready = asyncio.Event()
        self._logger = get_logger(component="hooks", parent_agent=parent_agent)
        self._records: DeliveryRecords | TenantDeliveryRecords = DeliveryRecords(None)
        self._calling: set[str] = set()  # the deliveries being checked or called
        self._held: dict[int, HeldHook] = {}  # the messages being handled, by stream seq
        self.call_hook = RecentKeys(CALLED_KEPT)  # the deliveries made and recorded here
        self._reports = DeliveryReports(tether, self._logger)
        self._stalls = StallWatch()  # a pause of this process voids its holds on hooks
        # Plain functions' threads, while serving: their own, so that functions that block
        # never hold up what else the loop's default executor runs (name lookups).
        self._threads: ThreadPoolExecutor | None = None

    def register(self, method: str, function: HookFunction) -> HookFunction:
        check_identifier(method, "hook method")
        registry_key(self.parent_agent, method)
        if not callable(function):
            raise TypeError(f"the {method} hook must be a function (run, result)")
        _check_takes_run_and_result(method, function)
        if method in self.functions:
            raise ValueError(f"a {method} hook is already registered for {self.parent_agent}")
        self.functions[method] = function
        return function

    def on_finish(self, method: str) -> Callable[[HookFunction], HookFunction]:
        """Decorator: `@hooks.on_finish("on_import_done")`."""
        return lambda function: self.register(method, function)

    def on_any_finish(self, function: HookFunction) -> HookFunction:
        """The global hook: every detached run of this parent agent, whatever its on_finish."""
        return self.register(GLOBAL_FINISH_HOOK, function)

    @asynccontextmanager
    async def running(self) -> AsyncIterator["HookRegistry"]:
        """Serve in the background; entered once every method is registered and consumed."""
        stop = asyncio.Event()
        task = asyncio.create_task(self.serve(stop))
        ready = asyncio.create_task(self.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            ready.cancel()
            task.result()  # raises why serving could not start
        try:
            yield self
        finally:
            stop.set()
            await task

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        """Register every method, then deliver until `stop` is set (calls in flight finish)."""
        if not self.functions:
            raise ValueError(f"no hooks registered for {self.parent_agent}")
        stop = stop or asyncio.Event()
        if self.tether.served:
            # In an account of its own: the parent registers each method and makes its
            # consumer; this handler's records are its own keys of the deliveries bucket.
            subscriptions = {method: await self._served_consumer(method)
                             for method in self.functions}
            self._records = TenantDeliveryRecords(self.tether.nc, self.tether.subjects)
        else:
            subscriptions = {method: await self._consume(method) for method in self.functions}
            self._records = await DeliveryRecords.open(self.tether.js,
                                                       self.tether.subjects.deliveries_bucket)
            await self._register_methods()
        self.ready.set()
        self._logger.info("hooks.serving", methods=sorted(self.functions),
                          lease_s=self.lease_s)
        self._stalls.start()
        self._threads = ThreadPoolExecutor(max_workers=self.concurrency * len(self.functions),
                                           thread_name_prefix="tether-hook")
        try:
            await asyncio.gather(*(self._deliver(method, subscription, stop)
                                   for method, subscription in subscriptions.items()))
        finally:
            self._threads.shutdown(wait=False)  # (every call has ended: `_deliver` waits)
            self._threads = None
            self._stalls.stop()
            self.ready.clear()
            for subscription in subscriptions.values():
                with suppress(Exception):
                    await subscription.unsubscribe()

    async def _register_methods(self) -> None:
        # Opened, not created: the parent service creates it, and an application's user
        # may only read its configuration and write its own parents' keys.
        name = self.tether.subjects.registry_bucket
        try:
            bucket = await self.tether.js.key_value(name)
        except NotFoundError:
            raise ServiceUnavailable(
                f"key-value bucket {name} does not exist: start the Tether services (the "
                "parent service creates it) or check the prefix") from None
        value = registration()
        for method in self.functions:
            key = registry_key(self.parent_agent, method)
            try:
                await unless_refused(self.tether.nc, f"$KV.{name}.{key}",
                                     bucket.put(key, value))
            except PublishDenied:
                raise self._not_permitted(method) from None

    async def _consume(self, method: str):
        subjects = self.tether.subjects
        durable = consumer_name(self.parent_agent, method)
        config = consumer_config(subjects, self.parent_agent, method, lease_s=self.lease_s,
                                 max_ack_pending=self.concurrency * 4)
        try:
            # Create or update: a changed lease applies to the existing consumer.
            return await unless_refused(
                self.tether.nc, f"$JS.API.CONSUMER.CREATE.{subjects.hooks_stream}.{durable}.",
                durable_pull(self.tether.js, self.tether.nc, subjects.hooks_stream, config))
        except NotFoundError:
            raise ServiceUnavailable(
                f"stream {subjects.hooks_stream} does not exist: start the Tether services "
                "(they create the streams) or check the prefix") from None
        except PublishDenied:
            raise self._not_permitted(method) from None

    async def _served_consumer(self, method: str) -> Pull:
        subject = (f"{self.tether.subjects.rpc('serve_hook')}."
                   f"{self.parent_agent}.{method}")
        query = ServeHookQuery(parent_agent=self.parent_agent, method=method,
                               lease_ms=max(int(self.lease_s * 1000), 1),
                               max_ack_pending=self.concurrency * 4)
        try:
            reply = await self.tether.request("serve_hook", query, ServeHookReply,
                                              subject=subject)
        except NotPermitted:
            raise self._not_permitted(method) from None
        return await Pull(self.tether.nc, self.tether.subjects.hooks_stream,
                          reply.consumer).start()

    def _not_permitted(self, method: str) -> NotPermitted:
        return NotPermitted(
            f"this connection's NATS user may not serve hook {method} of parent agent "
            f"{self.parent_agent}: an application user serves only the parent agents and "
            "hook methods its configuration lists (tether.access)")

    async def _deliver(self, method: str, subscription: Pull, stop: asyncio.Event) -> None:
        in_flight: set[asyncio.Task] = set()
        health = Health(self._logger, f"hooks:{method}")
        backoff = Backoff(max_s=1.0)
        try:
            while not stop.is_set():
                # A fetch also hands over what an earlier request delivered late, which
                # can be more than asked: in_flight may exceed the concurrency.
                free = self.concurrency - len(in_flight)
                if free <= 0:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    messages = await subscription.fetch(free, timeout=FETCH_WAIT_S)
                except TimeoutError:
                    continue
                except Exception as error:  # noqa: BLE001 - a NATS hiccup must not end the loop
                    health.failed(error)
                    await sleep_unless_stopped(stop, backoff.next_delay())
                    continue
                backoff.reset()
                health.recovered()
                for msg in messages:
                    hold = Hold.of_delivery(subscription.sent_at, subscription.arrived_at,
                                            self.lease_s, self._stalls)
                    task = asyncio.create_task(self._handle_guarded(method, msg, hold))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
        finally:
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)

    async def _handle_guarded(self, method: str, msg: Msg, hold: Hold) -> None:
        try:
            if not tracing.ENABLED:
                await self.handle(method, msg, hold)
            else:  # the run's trace goes on in this handler
                with tracing.span(f"process {msg.subject}", tracing.CONSUMER,
                                  carrier=msg.headers or {},
                                  attributes=tracing.messaging_attributes(
                                      "process", msg.subject, **{"tether.hook.method": method})):
                    await self.handle(method, msg, hold)
        except Exception as error:  # never lose a hook to a bug or a NATS hiccup
            if is_transient(error):
                self._logger.warning("hooks.handling_failed", method=method,
                                     error=describe(error))
            else:
                self._logger.exception("hooks.handling_failed", method=method)
            with suppress(Exception):
                await msg.nak(delay=self.lease_s)

    async def handle(self, method: str, msg: Msg, hold: Hold | None = None) -> None:
        """Deliver one hook message. `hold`: this handler's hold on it; one that went
        stale (the process was paused past the lease, and another handler may have the
        hook now) calls nothing and leaves the message to its redelivery."""
        try:
            hook = HookMessage.model_validate_json(msg.data)
        except ValidationError as error:
            self.stats.malformed += 1
            self._logger.error("hooks.malformed", method=method, error=str(error).splitlines()[0],
                               stream=self.tether.subjects.hooks_stream,
                               stream_seq=delivery_of(msg).stream_seq)
            await msg.term()
            return
        run, result = hook.run, hook.result
        delivery = delivery_of(msg)
        logger = self._logger.bind(method=method, run_id=run.run_id, status=result.status,
                                   stream_seq=delivery.stream_seq)
        held = self._held.get(delivery.stream_seq)
        if held is not None:
            held.adopt(msg, hold)
            logger.info("hooks.redelivered_while_held", delivered=delivery.delivered,
                        detail="this handler is still handling the message (a renewal came "
                               "late): it goes on with this delivery")
            return
        held = self._held[delivery.stream_seq] = HeldHook(msg, hold)
        try:
            await self._handle_held(method, held, hook, delivery, logger)
        finally:
            del self._held[delivery.stream_seq]

    async def _handle_held(self, method: str, held: HeldHook, hook: HookMessage,
                           delivery: Delivery, logger) -> None:
        run, result, msg, hold = hook.run, hook.result, held.msg, held.hold
        headers = msg.headers or {}
        message_id = headers.get("Nats-Msg-Id")
        held.first = delivery.delivered == 1 and headers.get(FIRST_PUBLICATION_HEADER) == "1"
        key = (delivery_key(run.parent, method, message_id) if message_id is not None
               else None)
        if key is not None:
            if key in self._calling:
                # Another publication of this outcome is being handled here now (the
                # parent's and the reconciler's retry, both at once): look again once it
                # is done.
                self.stats.deferred += 1
                logger.info("hooks.delivery_in_progress")
                await settle(msg.nak(delay=min(max(self.lease_s / 4, 0.05), 1.0)),
                             logger=logger, what="hook.nak")
                return
            if key in self.call_hook:
                await self._already_delivered(held.msg, logger)
                return
            # Claimed before the first look at the records: a copy arriving while this
            # one is being checked waits for it.
            self._calling.add(key)
        try:
            if await self._delivered_before(run, result.status, method, message_id, delivery,
                                            headers):
                await self._already_delivered(held.msg, logger)
                return
            if hold is not None and not hold.fresh:
                self.stats.left += 1
                logger.info("hooks.left_to_redelivery", detail=(
                    f"held for {hold.age_s:.1f}s without renewing it (this process was "
                    "stopped or paused): another handler may be calling it; left to its "
                    "redelivery"))
                return
            await self._call(method, held, hook, message_id, logger)
        finally:
            self._calling.discard(key)

    async def _delivered_before(self, run: RunInfo, status: str, method: str,
                                message_id: str | None, delivery: Delivery,
                                headers: dict[str, str]) -> bool:
        """Whether a record says this outcome's hook was delivered.

        The handler's own record is read for every message: a broker that restarts (or a
        consumer whose leader moves) can forget a delivery it made just before, and hand
        the message out again as a first delivery, to this handler or to another replica.
        The run's ledger is read as well for a message that could repeat an earlier one:
        a redelivery, or a publication the parent does not mark as its first for the
        outcome (a cleared run's ledger went with it, and a later run with its id keeps
        its own)."""
        if message_id is not None and await self._records.recorded(run.parent, method,
                                                                    message_id):
            return True
        if delivery.delivered == 1 and headers.get(FIRST_PUBLICATION_HEADER) == "1":
            return False
        state = (await self.tether.read_run(run.parent, run.run_id)).state
        return (state is not None and state.finish_delivered(status, method)
                and (message_id is None or names_this_life(message_id, state, status, method)))

    async def _call(self, method: str, held: HeldHook, hook: HookMessage,
                    message_id: str | None, logger) -> None:
        """Call the function, record the delivery, acknowledge. A call (with its records)
        that outlasts a third of the lease renews the hook until it is acknowledged, so
        the server does not hand it to another replica meanwhile; a hook's first call
        that runs past `FIRST_MARK_AFTER_S` is marked then (`_mark_held`: the
        reconciler's delivery lease may be shorter than this handler's). Most calls end
        before either, so timers start them, not a task per call."""
        loop = asyncio.get_running_loop()
        started: list[asyncio.Task] = []

        def start(work: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
            return lambda: started.append(asyncio.ensure_future(work()))

        timers = []
        if held.hold is not None:
            timers.append(loop.call_later(self.lease_s / 3, start(
                partial(self._renew, method, held, hook, message_id, logger))))
        if held.first:  # (any other call was marked before it started)
            timers.append(loop.call_later(min(FIRST_MARK_AFTER_S, self.lease_s / 3), start(
                partial(self._mark_held, method, hook, message_id, logger, held))))
        try:
            await self._call_and_record(method, held, hook, message_id, logger)
        finally:
            for timer in timers:
                timer.cancel()
            for task in started:
                task.cancel()

    async def _renew(self, method: str, held: HeldHook, hook: HookMessage,
                     message_id: str | None, logger) -> None:
        """An in-progress acknowledgement now and every third of the lease, with the mark
        of the call while the function runs (a failed one is tried at the next)."""
        assert held.hold is not None  # renewed only when held by a fetch
        while True:
            with suppress(*TRANSIENT_ERRORS):
                await held.hold.renew(held.msg)
                self.stats.renewed += 1
            if held.calling:
                await self._mark_held(method, hook, message_id, logger)
            await asyncio.sleep(self.lease_s / 3)

    async def _mark_held(self, method: str, hook: HookMessage, message_id: str | None,
                         logger, held: HeldHook | None = None) -> None:
        """The mark that this handler is calling the function (`DeliveryRecords`): while it
        is renewed, a retry of the reconciler's publishes no copy for another replica to
        call meanwhile. A mark that does not land leaves that retry as it was."""
        if message_id is None or (held is not None and not held.calling):
            return
        try:
            await self._records.mark_held(hook.run.parent, method, message_id,
                                          hook.result.status, int(self.lease_s * 1000))
        except TRANSIENT_ERRORS as error:
            logger.warning("hooks.mark_failed", error=describe(error))

    async def _call_and_record(self, method: str, held: HeldHook, hook: HookMessage,
                               message_id: str | None, logger) -> None:
        run, result = hook.run, hook.result
        if not held.first:  # a retry, which the reconciler may be about to copy
            await self._mark_held(method, hook, message_id, logger)
        held.calling = True
        try:
            outcome = await call_hook(self.functions[method], run, result, self._threads)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:  # the user's function failed: retry after the lease
            self.stats.failed += 1
            logger.exception("hooks.function_failed", retry_in_s=self.lease_s)
            # Its retry is the consumer's: marked, so the reconciler makes no copy of it.
            await self._mark_held(method, hook, message_id, logger)
            await settle(held.msg.nak(delay=self.lease_s), logger=logger, what="hook.nak")
            return
        finally:
            # (Before the delivered record: no renewal of the mark is put after it.)
            held.calling = False
        self.stats.called += 1
        # The function ran: from here on, a broker restart must not make it run again.
        # Both records are idempotent; they are retried until they land.
        if message_id is not None:
            async for attempt in Persisting("hooks.record", lambda: logger):
                with attempt:
                    await self._records.record(run.parent, method, message_id, result.status)
        await self._record_delivered(hook, method, message_id, logger)
        # Remembered once both records are on their way (until then a copy waits on the
        # claim): a copy acknowledged from memory never leaves the ledger without them.
        if message_id is not None:
            self.call_hook.add(delivery_key(run.parent, method, message_id))
        await settle(held.msg.ack(), logger=logger, what="hook.ack")
        logger.info("hooks.delivered")

    async def _already_delivered(self, msg: Msg, logger) -> None:
        self.stats.skipped += 1
        logger.info("hooks.already_delivered")
        await settle(msg.ack(), logger=logger, what="hook.ack")

    async def _record_delivered(self, hook: HookMessage, method: str,
                                message_id: str | None, logger) -> None:
        """The ledger entry, appended or (the parent's ledger) reported, retried until it
        lands."""
        run, status = hook.run, hook.result.status
        # The hook's own id names the run's life: the next life's delivery is another
        # report, and is never recorded on this one (nor this one's on the next).
        message_id = message_id or unknown_life_finish_id(run.run_id, status, method)
        report = DeliveryReport(run_id=run.run_id, parent=run.parent, status=status,
                                method=method, message_id=message_id)
        if self.ledger == "parent":
            await self._reports.send(report)
            return
        command = DeliveredCommand.of([report])
        async for attempt in Persisting("hooks.ledger", lambda: logger):
            with attempt:
                await self.tether.log.update(run.parent, run.run_id, partial(
                    record_delivery_of_this_life, command=command, now=SYSTEM_CLOCK.now()))
