"""The child-runner: pulls work items and runs child agents, several at a time.

One durable pull consumer per agent type on the work-queue stream (`runner-<agent_type>`,
filtered to that type's work subject), shared by every runner process: the server hands
each item to one of them, and hands it again after `work_ack_wait_ms` without a sign of
life, which is how a killed runner's run is resumed elsewhere. Each `Execution` keeps
its item alive with in-progress acknowledgements while the child runs.

Cancellation arrives as a core NATS `CancelSignal` broadcast to every runner of the
agent type (a faststream handler, like the child inspect); the one running the run stops
its child. Signals can be missed, so each
execution also looks for `run.cancel_requested` in the log at every heartbeat.

On stop (SIGTERM) the runner stops fetching, gives running children `shutdown_grace_s`
to finish, then stops the rest and gives their items back (NAK) so another runner
resumes them at once.
"""

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from contextlib import aclosing, suppress
from typing import Any

import msgspec
from faststream.middlewares import ExceptionMiddleware
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api as js_api
from pydantic import ValidationError

from tether import tracing
from tether.adapters.control import control_broker
from tether.adapters.holds import Hold, StallWatch
from tether.adapters.pull import Pull, delivery_of
from tether.adapters.requests import scatter
from tether.agent_registry import AgentRegistry
from tether.child.agent import ChildAgent
from tether.child.execution import Execution
from tether.child.work import Outcome, RunnerEnvironment
from tether.config import Settings
from tether.contract.messages import (
    CancelReply,
    CancelSignal,
    ChildInspectReply,
    ChildInspectRequest,
    ChildRecord,
    MessageSignal,
    RunnerVersion,
    WorkItem,
    read_work_item,
)
from tether.domain.versions import versions_serving
from tether.log import get_logger
from tether.metrics import DEAD_LETTERED, HANDLER_SECONDS, RUNNER_SLOTS_IN_USE, WORK_ITEMS
from tether.resilience import TRANSIENT_ERRORS, Backoff, Health, settle, sleep_unless_stopped

# Deliveries beyond `max_attempts`: a delivery can end without starting an attempt (a
# shutdown gives it back, a lost race skips it), and the last delivery must still reach a
# runner so that it records "gave up" instead of leaving the run open.
MAX_DELIVER_MARGIN = 3
FETCH_BATCH = 10
# How long a starting runner collects the other runners' versions of its agents' code.
VERSION_ANSWERS_S = 1.0
DEFAULT_SHUTDOWN_GRACE_S = 20.0


def new_runner_id() -> str:
    """hostname:pid:random, so a run's `run.running` says which process holds it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def consumer_name(agent_type: str) -> str:
    return f"runner-{agent_type}"


class _Slots:
    """At most `limit` children at once, shared by the fetch loops of every agent type.

    A loop fetches only as many items as there are free slots, and takes a slot per item
    in FIFO order (an asyncio.Semaphore), so no agent type can keep taking the slots the
    others are waiting for, and a fetched item never waits long for its child to start.
    """

    def __init__(self, limit: int) -> None:
        self._semaphore = asyncio.Semaphore(limit)
        self._freed = asyncio.Event()
        self._freed.set()
        self._closed = False

    @property
    def free(self) -> int:
        return self._semaphore._value  # noqa: SLF001 - asyncio.Semaphore has no public count

    async def wait_for_free(self) -> bool:
        """Until a slot is free (True), or the slots are closed (False)."""
        while not self._closed and self.free <= 0:
            self._freed.clear()
            await self._freed.wait()
        return not self._closed

    async def take(self, msg: Msg, keepalive_s: float, hold: Hold) -> None:
        """One slot for `msg`, keeping the item ours (`hold`) while it waits for one."""
        if not self._semaphore.locked():  # a free slot: taken at once, no timeout to set
            await self._semaphore.acquire()
            return
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    await self._semaphore.acquire()
                return
            except TimeoutError:
                await hold.renew(msg)

    async def give_back(self, count: int) -> None:
        for _ in range(count):
            self._semaphore.release()
        if count:
            self._freed.set()

    async def close(self) -> None:
        self._closed = True
        self._freed.set()


def consumer_config(settings: Settings, agent_type: str) -> js_api.ConsumerConfig:
    """The work consumer of one agent type, as every runner of it creates or updates it
    (so a changed ack wait or attempt limit takes effect on deploy)."""
    return js_api.ConsumerConfig(
        name=consumer_name(agent_type), durable_name=consumer_name(agent_type),
        filter_subject=settings.subjects.work(agent_type),
        ack_policy=js_api.AckPolicy.EXPLICIT, deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=settings.work_ack_wait_ms / 1000,
        max_deliver=settings.max_attempts + MAX_DELIVER_MARGIN,
        max_ack_pending=-1)


def runner_control(settings: Settings) -> NatsBroker:
    """The faststream broker of a runner's cancel, inspect and versions handlers (declared
    by `ChildRunner.subscribe_control`); a request that is not one gets no answer."""
    return control_broker(settings, "tether-child-runner-control",
                          middlewares=[ExceptionMiddleware(
                              handlers={ValidationError: _unreadable})])


def _unreadable(error: ValidationError, message: NatsMessage) -> None:
    get_logger(service="child-runner").warning(
        "control.unreadable", subject=message.raw_message.subject,
        error=str(error).splitlines()[0])


class ChildRunner:
    def __init__(self, nc: NATS, env: RunnerEnvironment,
                 registry: "AgentRegistry[ChildAgent]", *,
                 control: NatsBroker, pulls: Mapping[str, Pull],
                 shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                 fetch_timeout_s: float = 1.0,
                 on_outcome: Callable[[Outcome], None] | None = None) -> None:
        """The parts come made (`tether_services.child_runner.open_runner`, the runner's
        one wiring): `nc`, its connection; `env`, what its executions share; `control`, the broker of its
        control handlers (`runner_control`); `pulls`, a work consumer per agent type."""
        if not registry:
            raise ValueError("the child-runner needs at least one agent (TETHER_AGENTS or "
                             "--agents module:Class)")
        self._env, self._settings, self._registry = env, env.settings, registry
        self._nc = nc
        self.runner_id = env.runner_id
        self._shutdown_grace_s = shutdown_grace_s
        self._fetch_timeout_s = fetch_timeout_s
        self._on_outcome = on_outcome
        self._logger = get_logger(service="child-runner", runner_id=self.runner_id)
        self._slots = _Slots(env.settings.runner_concurrency)
        # Each run's executions in this process, oldest first: usually one, but a second
        # item for the run can arrive while the first still runs it.
        self._active: dict[tuple[str, str, str], list[Execution]] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._control = control
        self._pulls = dict(pulls)
        self._stalls = StallWatch()  # a pause of this process voids its holds on items
        self.consuming = False

    @property
    def control(self) -> NatsBroker:
        """The faststream broker of the cancel and inspect handlers."""
        return self._control

    def subscribe_control(self) -> None:
        """Declare the cancel and inspect handlers of every agent type (before starting)."""
        subjects = self._settings.subjects
        for agent_type in self._registry.agent_types:
            # A cancel is answered only by the runner holding the run (see `_on_cancel`).
            self._control.subscriber(subjects.cancel_signal(agent_type), no_reply=True,
                                     title=f"{subjects.cancel_signal(agent_type)}:cancel",
                                     description="Stop this run's child now")(self._on_cancel)
            self._control.subscriber(subjects.message_signal(agent_type), no_reply=True,
                                     title=f"{subjects.message_signal(agent_type)}:message",
                                     description="Hand this run's steering messages to its "
                                                 "child")(self._on_message)
            self._control.subscriber(subjects.inspect_child(agent_type),
                                     title=f"{subjects.inspect_child(agent_type)}:inspect",
                                     description="The child's record, if this runner holds "
                                                 "the run")(self._on_inspect)
            self._control.subscriber(subjects.runner_versions(agent_type),
                                     title=f"{subjects.runner_versions(agent_type)}:versions",
                                     description="Which version of the agent's code each "
                                                 "runner runs")(self._version_answer(agent_type))

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set, then shut down gracefully (see the module doc)."""
        # Each loop holds the slots it fetches for while its fetch waits, so no agent type
        # may take them all and keep the others waiting for a fetch timeout.
        batch = max(1, min(FETCH_BATCH, self._settings.runner_concurrency // len(self._pulls)))
        loops = [asyncio.create_task(self._consume(agent_type, pull, stop, batch),
                                     name=f"consume:{agent_type}")
                 for agent_type, pull in self._pulls.items()]
        self.consuming = True
        self._stalls.start()
        comparing = asyncio.create_task(self._compare_versions())
        self._logger.info("child_runner.consuming", agents=self._registry.agent_types,
                          concurrency=self._settings.runner_concurrency)
        try:
            await stop.wait()
        finally:
            comparing.cancel()
            self.consuming = False
            self._stalls.stop()
            await self._slots.close()
            # Each loop ends after its current fetch (at most `fetch_timeout_s`), which
            # does not leave a pull request behind to swallow an item after we are gone;
            # a runner cancelled instead of stopped ends them now.
            cancelled = not stop.is_set()
            if cancelled:
                for loop in loops:
                    loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._drain(grace=not cancelled)
            with suppress(*TRANSIENT_ERRORS):
                await self._control.stop()
            for pull in self._pulls.values():
                with suppress(*TRANSIENT_ERRORS):
                    await pull.unsubscribe()

    # --- versions of the agents' code ---------------------------------------------------

    def _version_answer(self, agent_type: str):
        own = self._registry.version(agent_type)

        async def answer(asked: RunnerVersion) -> RunnerVersion:
            if asked.runner_id != self.runner_id and asked.version != own:
                self._versions_differ(agent_type, versions_serving(
                    own, [(asked.runner_id, asked.version)]))
            return RunnerVersion(runner_id=self.runner_id, version=own)

        return answer

    async def _compare_versions(self) -> None:
        """Ask the other runners of each agent type which version of its code they run,
        and say so loudly when any runs another than this one (a rolling deploy, or two
        deployments serving one agent type by mistake)."""
        for agent_type in self._registry.agent_types:
            own = self._registry.version(agent_type)
            asked = RunnerVersion(runner_id=self.runner_id, version=own)
            others = []
            with suppress(*TRANSIENT_ERRORS):
                async with aclosing(scatter(
                        self._nc, self._settings.subjects.runner_versions(agent_type),
                        asked.model_dump_json().encode(), within_s=VERSION_ANSWERS_S)) as answers:
                    async for raw in answers:
                        with suppress(ValidationError):
                            answer = RunnerVersion.model_validate_json(raw)
                            if answer.runner_id != self.runner_id:
                                others.append((answer.runner_id, answer.version))
            if differ := versions_serving(own, others):
                self._versions_differ(agent_type, differ)

    def _versions_differ(self, agent_type: str, versions: dict[str, list[str]]) -> None:
        self._logger.warning(
            "agent.versions_differ", agent_type=agent_type, versions=versions,
            detail="runners with different code serve this agent type: a run begun by one "
                   "may be resumed by another (TETHER_RESUME_OTHER_VERSIONS)")

    async def _drain(self, *, grace: bool = True) -> None:
        """Let the running children finish within the shutdown grace, then give their
        work items back; without `grace` (the runner was cancelled), give them back now."""
        if not self._handlers:
            return
        self._logger.info("child_runner.draining", running=len(self._handlers),
                          grace_s=self._shutdown_grace_s if grace else 0)
        unfinished = set(self._handlers)
        if grace:
            _, unfinished = await asyncio.wait(unfinished, timeout=self._shutdown_grace_s)
        if unfinished:
            for executions in list(self._active.values()):
                for execution in executions:
                    execution.release_for_shutdown()
            await asyncio.wait(unfinished, timeout=self._shutdown_grace_s)

    async def _consume(self, agent_type: str, pull: Pull,
                       stop: asyncio.Event, batch: int) -> None:
        ack_wait_s = self._settings.work_ack_wait_ms / 1000
        keepalive_s = ack_wait_s / 3
        health = Health(self._logger.bind(agent_type=agent_type), f"work:{agent_type}")
        backoff = Backoff(max_s=1.0)
        while not stop.is_set():
            if not await self._slots.wait_for_free():
                return
            try:
                messages = await pull.fetch(min(batch, max(self._slots.free, 1)),
                                            timeout=self._fetch_timeout_s)
            except TimeoutError:  # nothing to do; nats' timeouts subclass the builtin one
                messages = []
            except Exception as error:  # noqa: BLE001 - a NATS hiccup must not end the loop
                # (A pull request rides on the connection's inbox, which nats-py subscribes
                # again after a reconnect; the consumer itself lives in the server's store.)
                health.failed(error)
                if await sleep_unless_stopped(stop, backoff.next_delay()):
                    return
                continue
            if messages or self._nc.is_connected:
                backoff.reset()
                health.recovered()
            for msg in messages:
                if stop.is_set():  # fetched as we were stopping: let another runner have it
                    await settle(msg.nak(), logger=self._logger, what="work_item.nak")
                    continue
                hold = Hold.of_delivery(pull.sent_at, pull.arrived_at, ack_wait_s,
                                        self._stalls)
                await self._slots.take(msg, keepalive_s, hold)
                handler = asyncio.create_task(self._handle(agent_type, msg, hold))
                self._handlers.add(handler)
                handler.add_done_callback(self._handlers.discard)

    async def _handle(self, agent_type: str, msg: Msg, hold: Hold) -> None:
        RUNNER_SLOTS_IN_USE.inc()
        try:
            try:
                item = read_work_item(msg.data)
            except (msgspec.DecodeError, RecursionError) as error:
                # Redelivering it would fail the same way.
                await self._term_work_item(
                    msg, "work_item.unreadable", agent_type=agent_type,
                    error=("nested too deeply" if isinstance(error, RecursionError)
                           else str(error).splitlines()[0]))
                return
            if item.agent_type != agent_type:
                # The consumer's type decides whose code runs, the item's the run it
                # starts: run both, and one agent's code would serve another's run.
                await self._term_work_item(
                    msg, "work_item.wrong_agent_type", agent_type=agent_type,
                    item_agent_type=item.agent_type, run_id=item.run_id,
                    parent=f"{item.parent.agent}/{item.parent.name}")
                return
            agent_cls = self._registry.get(agent_type)
            assert agent_cls is not None  # the consumer exists only for registered types
            key = (item.parent.agent, item.parent.name, item.run_id)
            if await self._adopted(key, msg, hold):
                return
            execution = Execution(self._env, agent_cls, msg, item, hold)
            executions = self._active.setdefault(key, [])
            executions.append(execution)
            try:
                outcome = await (execution.run() if not tracing.ENABLED
                                 else self._traced(execution, agent_type, item, msg))
            except Exception as error:  # the item is redelivered after ack_wait
                self._logger.error("work_item.error", run_id=item.run_id, agent_type=agent_type,
                                   parent=f"{item.parent.agent}/{item.parent.name}",
                                   attempt=execution.attempt,
                                   error=f"{type(error).__name__}: {error}", exc_info=error)
                return
            finally:
                executions.remove(execution)
                if not executions:
                    del self._active[key]
            self._log_outcome(outcome)
            if self._on_outcome is not None:
                self._on_outcome(outcome)
        finally:
            RUNNER_SLOTS_IN_USE.dec()
            await self._slots.give_back(1)

    async def _term_work_item(self, msg: Msg, what: str, **context: object) -> None:
        """Set aside a work item no runner can act on, saying where it is stored."""
        await settle(msg.term(), logger=self._logger, what="work_item.term")
        DEAD_LETTERED.inc(kind="work_item")
        self._logger.error(what, stream=self._settings.subjects.work_stream,
                           stream_seq=delivery_of(msg).stream_seq, **context)

    async def _traced(self, execution: Execution, agent_type: str, item: WorkItem,
                      msg: Msg) -> Outcome:
        """The child's run as an `invoke_agent` span, continuing the work item's trace."""
        attributes = tracing.invoke_agent_attributes(agent_type, item.run_id, item.parent)
        attributes["tether.dispatch"] = item.dispatch
        with tracing.span(f"invoke_agent {agent_type}", tracing.INTERNAL,
                          carrier=msg.headers or {}, attributes=attributes) as span:
            outcome = await execution.run()
            span.set_attribute("tether.outcome", outcome.kind)
            return outcome

    async def _adopted(self, key: tuple[str, str, str], msg: Msg, hold: Hold) -> bool:
        """Whether `msg` is a redelivery of an item this process still runs: the server
        redelivers what it did not hear about for the ack wait, as after its own restart
        or a reconnection. The running execution takes the new delivery over (its
        heartbeat and its ack go there); a second one would run the child again."""
        for execution in self._active.get(key, ()):
            if execution.holds(msg):
                execution.adopt(msg, hold)
                await settle(msg.in_progress(), logger=self._logger, what="work_item.progress")
                self._logger.info("work_item.redelivered_to_holder", run_id=key[2],
                                  attempt=execution.attempt)
                return True
        return False

    def _log_outcome(self, outcome: Outcome) -> None:
        WORK_ITEMS.inc(agent_type=outcome.agent_type, outcome=outcome.kind)
        HANDLER_SECONDS.observe(outcome.duration_ms / 1000, service="child-runner", handler="work")
        fields: dict[str, Any] = {
            "run_id": outcome.run_id, "agent_type": outcome.agent_type,
            "parent": f"{outcome.parent.agent}/{outcome.parent.name}",
            "outcome": outcome.kind, "attempt": outcome.attempt,
            "duration_ms": outcome.duration_ms}
        if outcome.detail:
            fields["detail"] = outcome.detail
        if outcome.exception is not None:
            self._logger.warning("work_item.done", exc_info=outcome.exception, **fields)
        else:
            self._logger.info("work_item.done", **fields)

    async def _on_cancel(self, signal: CancelSignal, message: NatsMessage) -> None:
        executions = list(self._active.get(
            (signal.parent.agent, signal.parent.name, signal.run_id), ()))
        if not executions:
            return  # only the runner holding the run answers a cancel request
        for execution in executions:
            execution.cancel(signal.reason)
        if message.reply_to:
            # Asked as a request: say whether the child really stopped, from a task of its
            # own, so that cancels falling due together are each answered within their
            # grace, not one after another.
            replying = asyncio.create_task(self._reply_when_stopped(executions, message))
            self._handlers.add(replying)
            replying.add_done_callback(self._handlers.discard)

    async def _on_message(self, signal: MessageSignal) -> None:
        """Only the runner holding the run hands its messages over (`Execution.look_for_messages`)."""
        for execution in self._active.get(
                (signal.parent.agent, signal.parent.name, signal.run_id), ()):
            execution.look_for_messages()

    async def _reply_when_stopped(self, executions: list[Execution],
                                  message: NatsMessage) -> None:
        grace = self._env.cancel_grace_s + 1.0
        with suppress(TimeoutError):
            async with asyncio.timeout(grace):
                for execution in executions:
                    await execution.finished.wait()
        reply = CancelReply(had_run=True, stopped=all(e.finished.is_set() for e in executions))
        with suppress(*TRANSIENT_ERRORS):
            await message.raw_message.respond(reply.model_dump_json().encode())

    async def _on_inspect(self, request: ChildInspectRequest) -> ChildInspectReply:
        """Every runner answers; "no record" from all of them means "not started yet"."""
        executions = self._active.get((request.parent.agent, request.parent.name,
                                       request.run_id))
        record = None
        if executions:
            execution = executions[-1]  # the latest item's: a takeover is the run's attempt
            record = ChildRecord(status=execution.child_status, attempt=execution.attempt,
                                 runner_id=self.runner_id)
        return ChildInspectReply(record=record)
