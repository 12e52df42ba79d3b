"""The parent service: consumes commands, answers inspect/list/has-run, delivers the hooks
of the outcomes it appends (a cancel's).

Commands are pulled from a durable consumer shared by every parent replica, a batch at a
time; commands for the same run are handled in order, different runs concurrently. A
command is acknowledged after its events are appended; a failure leaves it to be
redelivered (bounded), and a command that can never be handled is moved to the
dead-letter subject with the reason.
"""

import asyncio
import json
from collections import defaultdict
from contextlib import suppress

from faststream.nats import NatsBroker
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from tether import tracing
from tether.access import COMMAND_KINDS
from tether.adapters.broker_clock import BrokerClock
from tether.adapters.event_log import EventLog
from tether.adapters.pull import delivery_of, durable_pull
from tether.config import Settings
from tether.delivery.deliverer import Deliverer
from tether.domain.commands import overdue_ms
from tether.metrics import DEAD_LETTERED, HANDLER_SECONDS
from tether.parent.command_parsing import Payload, UnparseableCommand
from tether.parent.handlers import CommandHandlers
from tether.resilience import TRANSIENT_ERRORS, Persisting, settle, supervise

MAX_COMMAND_DELIVERIES = 10
CLOCK_SAMPLE_WAIT_S = 5.0


class ParentService:
    def __init__(self, settings: Settings, log: EventLog, handlers: CommandHandlers,
                 queries: NatsBroker, deliverer: Deliverer, logger,
                 clock: BrokerClock | None = None) -> None:
        """The parts come made (`tether_services.parent.open_parent`, the parent's one
        wiring): `handlers` decide each command, `queries` is the started broker that
        answers inspect/list/has-run, `deliverer` the handlers' (hooks of what they
        append). `clock`: the broker's, which commands' expiries are
        counted on (default: one of this service's own, sampled as it runs)."""
        self._settings = settings
        self._log = log
        self._js = log.jetstream
        self._subjects = log.subjects
        self._handlers = handlers
        self._queries = queries
        self._deliverer = deliverer
        self._logger = logger
        self._clock = clock
        self.handled = 0

    @property
    def deliverer(self) -> Deliverer:
        return self._deliverer

    @property
    def queries(self) -> NatsBroker:
        """The faststream broker answering the queries."""
        return self._queries

    async def run(self, stop: asyncio.Event) -> None:
        sampling = None
        if self._clock is None:
            self._clock = BrokerClock(self._log.nats, self._subjects.events_stream, self._logger)
            sampling = asyncio.create_task(self._clock.run(stop))
        # Expiries are counted on the broker's clock: its first sample comes before the
        # first command (a broker too slow to answer leaves this process's clock).
        with suppress(TimeoutError):
            async with asyncio.timeout(CLOCK_SAMPLE_WAIT_S):
                await self._clock.sampled()
        try:
            await self._consume_commands(stop)
        finally:
            if sampling is not None:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
            with suppress(*TRANSIENT_ERRORS):
                await self._queries.stop()

    # --- commands -------------------------------------------------------------------

    async def _consume_commands(self, stop: asyncio.Event) -> None:
        await supervise("commands", lambda progressed: self._command_loop(stop, progressed),
                        stop, self._logger)

    async def _command_loop(self, stop: asyncio.Event, progressed) -> None:
        """Fetch and handle commands until `stop`; a broker error ends it (and `supervise`
        binds to the durable consumer again after a backoff)."""
        durable = "parent-commands"
        config = js_api.ConsumerConfig(
            durable_name=durable, ack_policy=js_api.AckPolicy.EXPLICIT,
            deliver_policy=js_api.DeliverPolicy.ALL, ack_wait=30,
            max_deliver=MAX_COMMAND_DELIVERIES, max_ack_pending=1024,
            filter_subjects=[subject for kind in COMMAND_KINDS
                             for subject in (self._subjects.command(kind),
                                             self._subjects.command(kind) + ".*.*")],
        )
        subscription = await durable_pull(self._js, self._log.nats, self._subjects.commands_stream,
                                          config)
        try:
            while not stop.is_set():
                try:
                    messages = await subscription.fetch(64, timeout=0.5)
                except TimeoutError:
                    if self._log.nats.is_connected:
                        progressed()
                    continue
                progressed()
                # Each payload is parsed once, here, for its run and for its handler.
                by_run: dict[str, list[tuple[Msg, Payload]]] = defaultdict(list)
                for msg in messages:
                    payload = _payload(msg.data)
                    by_run[_run_key(msg, payload)].append((msg, payload))
                await asyncio.gather(*(self._in_order(batch, stop) for batch in by_run.values()))
        finally:
            with suppress(*TRANSIENT_ERRORS):
                await subscription.unsubscribe()

    async def _in_order(self, commands: list[tuple[Msg, Payload]], stop: asyncio.Event) -> None:
        for msg, payload in commands:
            await self._handle_command(msg, payload, stop)

    async def _handle_command(self, msg: Msg, payload: Payload, stop: asyncio.Event) -> None:
        if not tracing.ENABLED:
            return await self._handle(msg, payload, stop)
        kind = msg.subject.split(".")[2]
        subject = self._subjects.command(kind)
        attributes = tracing.messaging_attributes("process", subject)
        if isinstance(payload, dict) and isinstance(payload.get("run_id"), str):
            attributes["tether.run.id"] = payload["run_id"]
        with tracing.span(f"process {subject}", tracing.CONSUMER, carrier=msg.headers or {},
                          attributes=attributes):
            return await self._handle(msg, payload, stop)

    async def _handle(self, msg: Msg, payload: Payload, stop: asyncio.Event) -> None:
        seq, delivered, _, stored_at = delivery_of(msg)
        kind = msg.subject.split(".")[2]
        clock = HANDLER_SECONDS.start()
        log = self._logger.bind(subject=msg.subject, stream_seq=seq)
        try:
            _check_subject_parent(msg.subject, payload)
            assert self._clock is not None
            overdue = overdue_ms(payload, stored_at, self._clock.now())
            if overdue is not None and kind not in ("run", "send"):
                log.warning("command.expired", kind=kind, overdue_ms=overdue,
                            run_id=payload.get("run_id") if isinstance(payload, dict) else None)
                self.handled += 1
                await settle(msg.ack(), logger=log, what="command.ack")
                return
            # Handlers decide from the run's events and append with its ids, so one retried
            # across a broker restart lands once; until `stop`, then redelivery retries it.
            async for attempt in Persisting(f"command.{kind}", lambda: log,
                                            give_up=stop):
                with attempt:
                    await self._dispatch(kind, payload, seq, log, overdue)
        except UnparseableCommand as error:
            await self._dead_letter(msg, str(error))
            log.error("command.dead_lettered", error=str(error))
        except Exception as error:  # noqa: BLE001 - retried by redelivery, then dead-lettered
            if delivered >= MAX_COMMAND_DELIVERIES:
                await self._dead_letter(msg, f"failed {MAX_COMMAND_DELIVERIES} times: {error!r}")
                log.error("command.dead_lettered", error=repr(error))
            else:
                log.warning("command.failed", error=repr(error),
                            delivered=delivered)
                await settle(msg.nak(delay=min(0.2 * 2 ** delivered, 10.0)), logger=log,
                             what="command.nak")
                return
        self.handled += 1
        clock.observe(service="parent", handler=f"command.{kind}")
        await settle(msg.ack(), logger=log, what="command.ack")

    async def _dispatch(self, kind: str, payload: Payload, seq: int, log,
                        overdue: int | None = None) -> None:
        if kind == "run":
            outcome = await self._handlers.run(payload, seq, overdue=overdue)
            log.info("command.run", decision=outcome.decision, status=outcome.status,
                     code=outcome.code)
        elif kind == "cancel":
            status = await self._handlers.cancel(payload, seq)
            log.info("command.cancel", status=status)
        elif kind == "continue":
            result = await self._handlers.continue_run(payload, seq)
            log.info("command.continue", result=result)
        elif kind == "delivered":
            result = await self._handlers.record_delivery(payload)
            log.info("command.delivered", result=result)
        elif kind == "message":
            result = await self._handlers.message(payload)
            log.info("command.message", result=result)
        elif kind == "send":
            result = await self._handlers.send(payload, seq, overdue=overdue)
            log.info("command.send", result=result)
        else:
            cleared = await self._handlers.clear(payload, seq)
            log.info("command.clear", cleared=len(cleared))

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        DEAD_LETTERED.inc(kind="command")
        await self._js.publish(self._subjects.command_dead_letters, msg.data, headers={
            "Tether-Error": reason[:1000], "Tether-Subject": msg.subject,
            "Tether-Stream-Seq": str(msg.metadata.sequence.stream)},
            stream=self._subjects.commands_stream)


FORMER_DELIVERIES_CONSUMER = "parent-deliverer"


async def remove_former_deliveries_consumer(js, events_stream: str) -> None:
    """Remove the durable consumer `parent-deliverer` where an installation still has it
    (the writers of outcomes deliver hooks; CHANGELOG.md says since when): nobody reads
    it, and it would keep every event after it pending on the server."""
    with suppress(NotFoundError):
        await js.delete_consumer(events_stream, FORMER_DELIVERIES_CONSUMER)


def _payload(data: bytes) -> Payload:
    """A command's JSON object, or its bytes when they are not one (its handler says why)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the stack
        return data
    return value if isinstance(value, dict) else data


def _check_subject_parent(subject: str, payload: Payload) -> None:
    """A per-parent subject (`<prefix>.cmd.<kind>.<agent>.<name>`) must name the payload's
    parent: permissions are granted on the subject, so the payload may not reach past it."""
    tokens = subject.split(".")
    if len(tokens) != 5:
        return
    if not isinstance(payload, dict):  # bytes: `_payload` found no JSON object in them
        raise UnparseableCommand("not a JSON object")
    parent = payload.get("parent") or {}
    if not isinstance(parent, dict):
        parent = {}
    if [parent.get("agent"), parent.get("name")] != tokens[3:]:
        raise UnparseableCommand(
            f"the payload's parent {parent.get('agent')}/{parent.get('name')} differs from "
            f"the subject's {tokens[3]}/{tokens[4]}")


def _run_key(msg: Msg, payload: Payload) -> str:
    """Commands of one run are handled in order; clears are ordered per parent."""
    parent = (payload.get("parent") or {}) if isinstance(payload, dict) else None
    if not isinstance(payload, dict) or not isinstance(parent, dict):
        return f"unparseable.{delivery_of(msg).stream_seq}"
    return f"{parent.get('agent')}.{parent.get('name')}.{payload.get('run_id', '*')}"
