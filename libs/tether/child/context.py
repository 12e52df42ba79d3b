"""What a child agent gets in `run(ctx, input)`: its run, progress, milestones, output, cancel.

The same child code must also run standalone (a script, a unit test, an agent used as a
plain object): every reporting call then becomes a no-op that logs one development
warning per process for `report_progress()` outside a run.
"""

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticSerializationError, to_jsonable_python

from tether.domain.chat import ChatKey, chat_of, chat_of_new_run
from tether.domain.events import ParentRef, RunRef
from tether.domain.fold import evolve
from tether.domain.ids import (
    check_identifier,
    nested_call_digest,
    nested_parent_name,
    nested_run_id,
    remote_run_id,
)
from tether.domain.waiting import waiting_below
from tether.log import get_logger

# How long a run whose nested run was aborted by a cancel of this run waits for the runner
# to stop it (the runner's cancel signal, or its heartbeat) before it stops by itself.
CANCEL_NOTICE_S = 60.0

if TYPE_CHECKING:
    from tether.child.recorder import RunRecorder
    from tether.domain.run_state import RunState, SteeringMessage

_current: ContextVar["RunContext | None"] = ContextVar("tether_run_context", default=None)
_warned_outside_run = False


class RunCancelled(Exception):
    """Raised by `ctx.raise_if_cancelled()`; the runner records the run as `aborted`."""


class RunSuperseded(RunCancelled):
    """The child lost the run: a newer attempt holds it (`superseded`) or it ended
    elsewhere (`gone`). The runner stops the child and records nothing for it."""

    def __init__(self, message: str, reason: str = "superseded") -> None:
        super().__init__(message)
        self.reason = reason


def current_context() -> "RunContext | None":
    """The context of the agent-tool run this task belongs to; None outside a run."""
    return _current.get()


async def first_of(work: Awaitable[Any], ctx: "RunContext") -> tuple[bool, Any]:
    """(True, result) when `work` ends first, (False, None) when the run is cancelled
    first (`work` is then cancelled): a child's way to stop what it awaits on a cancel."""
    return await unless_set(work, ctx.cancelled)


async def unless_set(work: Awaitable[Any], *events: asyncio.Event) -> tuple[bool, Any]:
    """(True, result) when `work` ends first, (False, None) when one of `events` is set
    first (`work` is then cancelled, and has unwound when this returns)."""
    task = asyncio.ensure_future(work)
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # this child's own task was cancelled (the runner is stopping)
        raise
    finally:
        for waiter in waiters:
            waiter.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False, None


def bind_context(ctx: "RunContext") -> None:
    """Make `ctx` the current context of the calling task (the runner's child task).

    A task runs in a copy of the context it was created in, so this never leaks into the
    runner's own tasks.
    """
    _current.set(ctx)


async def report_progress(fraction: float | None = None, message: str | None = None,
                          phase: str | None = None, milestone: str | None = None,
                          data: Any = None, persist: bool = False) -> None:
    """`ctx.report_progress` for the current run; a no-op with a warning outside one."""
    ctx = current_context()
    if ctx is None:
        check_progress(fraction, milestone, data, message, phase)
        _warn_outside_run()
        return
    await ctx.report_progress(fraction=fraction, message=message, phase=phase,
                              milestone=milestone, data=data, persist=persist)


def _warn_outside_run() -> None:
    global _warned_outside_run
    if _warned_outside_run:
        return
    _warned_outside_run = True
    get_logger().warning(
        "report_progress.outside_run",
        detail="report_progress/output was called outside an agent-tool run, so it does "
               "nothing; this is expected when the child runs standalone (shown once)")


def check_progress(fraction: float | None, milestone: str | None, data: Any,
                   message: str | None = None,
                   phase: str | None = None) -> tuple[float | None, Any]:
    """Refuse a bad signal where the child made it, not later in the runner. Returns the
    fraction as a float and the data as JSON-ready values (a model as its dict, a
    datetime as its ISO text), the forms the events and signals carry."""
    for name, text in (("message", message), ("phase", phase)):
        if text is not None and not isinstance(text, str):
            raise TypeError(f"progress {name} must be a str, not {type(text).__name__}")
    if fraction is not None and (isinstance(fraction, bool)
                                 or not isinstance(fraction, (int, float))
                                 or math.isnan(fraction) or not 0.0 <= fraction <= 1.0):
        raise ValueError(f"progress fraction must be a number from 0 to 1, not {fraction!r}")
    if milestone is not None:
        check_identifier(milestone, "milestone name")
    if data is not None:
        try:
            data = to_jsonable_python(data)
        except PydanticSerializationError as error:
            raise ValueError(f"progress data must be JSON-serialisable: {error}") from None
    return (None if fraction is None else float(fraction)), data


class RunContext:
    """One attempt of one run, as the child sees it.

    `client` is how a child becomes a parent itself (nested agent tools): the runner sets
    it to an object whose `run_agent_tool(agent_type, input, **options)` starts a run
    owned by `ctx.as_parent()`, i.e. by this child's agent type and this run's name as a
    parent (its run id and a digest of its path from the root), so the nested runs appear
    on their own parent timeline and never on another tree's. It is None until a client factory
    is given to the runner; `run_agent_tool` then says so instead of failing obscurely.
    """

    def __init__(self, *, run_id: str, parent: ParentRef, agent_type: str, attempt: int,
                 recorder: "RunRecorder | None", client: Any = None,
                 client_factory: Callable[[ParentRef], Any] | None = None,
                 history: "RunState | None" = None,
                 stop_reason: Callable[[], str | None] | None = None) -> None:
        """`client_factory`: makes `client` (given `as_parent()`) when a child first asks
        for it; most children never do. `stop_reason`: why the runner stops this attempt
        (`RunContext.stop_reason`)."""
        self.run_id = run_id
        self.parent = parent
        self.agent_type = agent_type
        self.attempt = attempt
        self._client = client
        self._client_factory = client_factory
        self.cancelled = asyncio.Event()
        # The run as it stood when this attempt began (recorded steps, pauses and their
        # answers), so a child that records its steps can resume after the last one.
        self.history = history
        # A finer status for inspect while the child runs (the agent runtime's
        # running / waiting_for_human ...); None: the runner's own.
        self.child_status: str | None = None
        # When the runner let this attempt's child start (epoch ms, this machine's clock),
        # read before it checked that the attempt was still the run's: a process stopped
        # after the check started its child then, whenever the child's first line runs.
        self.started_at: int | None = None
        self._recorder = recorder
        self._nested_calls: dict[str, int] = {}
        self._stop_reason = stop_reason
        # Steering messages the runner handed over and the child has not taken in.
        self._inbox: list[SteeringMessage] = []
        self._offered: set[str] = set()
        self._inbox_lock = asyncio.Lock()
        self._arrived = asyncio.Event()  # set while `_inbox` holds a message
        # Set while an `interrupt` message waits: the child's current model or tool call
        # is to stop (`interruptible`) so that the child takes the message in.
        self.interrupted = asyncio.Event()

    @property
    def stop_reason(self) -> str | None:
        """Why the runner stops this attempt; None while it runs. `"cancel"` (the run was
        cancelled) and `"give-up"` (a budget ran out) end the run, so what the child
        started elsewhere should be stopped too; `"superseded"` (another attempt holds the
        run), `"gone"` (it ended elsewhere) and `"shutdown"` (this runner is stopping and
        gives the run back) leave the run to another attempt, which should pick up what
        this one started."""
        return None if self._stop_reason is None else self._stop_reason()

    @classmethod
    def standalone(cls, agent_type: str = "standalone",
                   run_id: str = "standalone") -> "RunContext":
        """A context for running a child outside Tether: reporting does nothing."""
        return cls(run_id=run_id, parent=ParentRef(agent=agent_type, name="standalone"),
                   agent_type=agent_type, attempt=1, recorder=None)

    @property
    def turn(self) -> int:
        """The run's turn: 1, or a follow-up's number (`ctx.history.turns`: the earlier
        turns, each with its input and outcome)."""
        return self.history.turn if self.history is not None else 1

    @property
    def overrides(self) -> dict[str, Any]:
        """What this run, a fork, changes in how its agent runs (`ChildAgent.overrides_model`
        checked them when the fork was asked for); {} for any other run."""
        fork = self.history.forked_from if self.history is not None else None
        return dict(fork.overrides) if fork is not None else {}

    @property
    def remote_run_id(self) -> str:
        """The id this run goes by at a remote agent (`tether.domain.ids.remote_run_id`):
        its run id, and a digest of its parent and this life of the run id."""
        return remote_run_id(self.parent.agent, self.parent.name, self.run_id,
                             self.history.incarnation if self.history is not None else "")

    @property
    def in_run(self) -> bool:
        return self._recorder is not None

    def raise_if_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise RunCancelled(f"run {self.run_id} was cancelled")

    async def ensure_current(self) -> None:
        """Await this right before an action outside the log that must not happen twice
        (a call to another system, a message sent): it returns at once while this
        attempt surely holds the run. After this process was paused past its hold on the
        run's work item (stopped, swapped out), it reads the run first, and an attempt
        that another one took over gets `RunSuperseded` (the runner stops the child and
        records nothing for it) instead of acting twice. Standalone, this does nothing."""
        if self._recorder is not None:
            await self._recorder.ensure_current()

    async def report_progress(self, fraction: float | None = None, message: str | None = None,
                              phase: str | None = None, milestone: str | None = None,
                              data: Any = None, persist: bool = False) -> None:
        """Report progress; with `milestone`, a durable milestone.

        Without a milestone the signal is ephemeral: coalesced per run (latest value wins,
        at most one per `progress_coalesce_ms`, `fraction >= 1` at once) and published on
        the run's progress subject. The run's progress snapshot in the log follows it at
        most once per `progress_persist_ms`, counted from the attempt's start
        (`persist=True` at once; the latest other one when its window ends or before the
        run's outcome, unless a milestone, itself a later snapshot, came first); its
        `data` is kept only with `persist=True`. A milestone is always recorded, in
        order, with the run's next sequence; on a resumed run it is not recorded twice.
        """
        fraction, data = check_progress(fraction, milestone, data, message, phase)
        if self._recorder is None:
            _warn_outside_run()
            return
        if milestone is not None:
            await self._recorder.milestone(milestone, fraction=fraction, message=message,
                                           phase=phase, data=data)
        else:
            await self._recorder.progress(fraction=fraction, message=message, phase=phase,
                                          data=data, persist=persist)

    async def output(self, text: str) -> None:
        """Stream a chunk of the child's output text (recorded as `run.output`)."""
        if not isinstance(text, str):
            raise TypeError(f"output text must be a str, not {type(text).__name__}")
        if self._recorder is None:
            _warn_outside_run()
            return
        if text:
            await self._recorder.output(text)

    async def record_step(self, index: int, step: dict[str, Any]) -> None:
        """Record a completed step (`run.step_recorded`) before the child goes on.

        Only the attempt that holds the run records; an attempt that lost it gets
        `RunSuperseded`. Standalone, this does nothing.
        """
        if not isinstance(step, dict):
            raise TypeError(f"a step is a dict, not {type(step).__name__}")
        try:
            step = to_jsonable_python(step)
        except PydanticSerializationError as error:
            raise ValueError(f"a step must be JSON-serialisable: {error}") from None
        if self._recorder is not None:
            await self._recorder.step(index, step)

    def replay_milestones(self, names: "list[str] | tuple[str, ...]") -> None:
        """Milestones that steps recorded earlier reported: a resumed child that skips
        those steps declares them, so its next milestone of the same name is recorded."""
        if self._recorder is not None:
            self._recorder.replay_milestones(names)

    # --- steering messages ----------------------------------------------------------------

    async def offer(self, messages: "Iterable[SteeringMessage]") -> None:
        """The runner hands over the run's steering messages not taken in yet (each once,
        whatever it is offered again): recorded `run.message_delivered`, then waiting in
        `waiting_messages`; an `interrupt` message sets `interrupted`."""
        async with self._inbox_lock:
            for message in messages:
                if message.message_id in self._offered or message.consumed_at is not None:
                    continue
                self._offered.add(message.message_id)
                if self._recorder is not None and message.delivered_at is None:
                    await self._recorder.message_receipt("delivered", message.message_id)
                self._inbox.append(message)
                if message.mode == "interrupt":
                    self.interrupted.set()
            if self._inbox:
                self._arrived.set()

    @property
    def offered(self) -> frozenset[str]:
        """The ids of the messages handed over in this attempt (taken in or not)."""
        return frozenset(self._offered)

    @property
    def waiting_messages(self) -> "tuple[SteeringMessage, ...]":
        """The steering messages handed over and not taken in yet, in the order sent."""
        return tuple(self._inbox)

    async def consume(self, message_ids: "Iterable[str]") -> None:
        """Take in these waiting messages: each is recorded `run.message_consumed` and is
        never handed over again, to this attempt or a later one. A child that needs a
        message after a crash keeps it in a step of its own first (as the model agent
        does, in the conversation)."""
        wanted = set(message_ids)
        async with self._inbox_lock:
            for message in [m for m in self._inbox if m.message_id in wanted]:
                if self._recorder is not None:
                    await self._recorder.message_receipt("consumed", message.message_id)
                self._inbox.remove(message)
            if not any(m.mode == "interrupt" for m in self._inbox):
                self.interrupted.clear()
            if not self._inbox:
                self._arrived.clear()

    async def messages(self) -> "list[SteeringMessage]":
        """The parent's messages that have arrived and not been taken in, taken in now
        (`consume`); [] when there are none. Call it at a step boundary."""
        taken = list(self._inbox)
        await self.consume(m.message_id for m in taken)
        return taken

    async def next_message(self, timeout: float | None = None) -> "SteeringMessage | None":
        """The parent's next message, taken in: at once when one is waiting, else when one
        arrives; None after `timeout` seconds without one. `RunCancelled` when the run is
        cancelled meanwhile."""
        try:
            async with asyncio.timeout(timeout):
                while not self._inbox:
                    arrived, _ = await first_of(self._arrived.wait(), self)
                    if not arrived:
                        raise RunCancelled(f"run {self.run_id} was cancelled")
        except TimeoutError:
            return None
        message = self._inbox[0]
        await self.consume([message.message_id])
        return message

    async def interruptible(self, work: Awaitable[Any]) -> tuple[bool, Any]:
        """(True, result) when `work` ends first; (False, None) when an `interrupt`
        message arrives first (`work` is cancelled: take the message in with
        `messages()` and go on with it). `RunCancelled` when the run is cancelled first."""
        done, result = await unless_set(work, self.interrupted, self.cancelled)
        if not done and self.cancelled.is_set():
            raise RunCancelled(f"run {self.run_id} was cancelled")
        return done, result

    @property
    def client(self) -> Any:
        if self._client is None and self._client_factory is not None:
            self._client = self._client_factory(self.as_parent())
        return self._client

    @client.setter
    def client(self, client: Any) -> None:
        self._client = client

    @property
    def reported_milestones(self) -> tuple[str, ...]:
        """Names of the milestones reported in this attempt so far, replays included."""
        return tuple(self._recorder.reported_milestones) if self._recorder is not None else ()

    def as_parent(self) -> ParentRef:
        """This run as the parent of nested agent-tool runs: its agent type and its name
        as a parent (`RunState.as_parent`), unique across parents and tenants although
        its run id is unique only per parent."""
        if self.history is not None:
            return self.history.as_parent()
        return ParentRef(agent=self.agent_type,
                         name=nested_parent_name(self.parent.agent, self.parent.name,
                                                 self.run_id))

    def chat(self) -> ChatKey:
        """The chat this run speaks on (a model parent's conversation,
        `tether.domain.chat`): its user messages, its answers and the notifications of
        the runs it started."""
        if self.history is not None:
            return chat_of(self.history)
        return chat_of_new_run(self.parent, self.run_id)

    def nested_run_id(self, agent_type: str, input: Any) -> str:
        """The run id of the next nested call of `agent_type` with `input`.

        `<run_id>:<call>:<n>`: `<call>` hashes the agent type and the input (in a follow-up
        turn, `t<turn>-` before it), `<n>` counts the calls with both alike in this
        attempt (from 0). A resumed child that calls
        again, with or without the calls before this one, gets the same ids, so a
        repeated call finds the grandchild's run instead of starting a second turn.
        """
        call = nested_call_digest(agent_type, input)
        if self.turn > 1:  # a follow-up's calls are its own, not an earlier turn's
            call = f"t{self.turn}-{call}"
        n = self._nested_calls.get(call, 0)
        self._nested_calls[call] = n + 1
        return nested_run_id(self.run_id, call, n)

    async def run_agent_tool(self, agent_type: str, input: dict[str, Any], **options: Any) -> Any:
        """Delegate to another child agent, with this run as its parent; without a
        `run_id`, the call's is `nested_run_id(agent_type, input)`."""
        if self.client is None:
            raise RuntimeError(
                "nested agent tools need a Tether client: give the child-runner a "
                "parent_client factory so that ctx.client is set")
        if options.get("run_id") is None and options.get("follow_up") is None:
            options["run_id"] = self.nested_run_id(agent_type, input)
        if self._recorder is not None:
            options.setdefault("started_by", RunRef(parent=self.parent, run_id=self.run_id))
            await self.ensure_current()  # an attempt that lost the run asks for nothing
        if options.get("detached") or self._recorder is None:
            return await self.client.run_agent_tool(agent_type, input, **options)
        relay = asyncio.create_task(self._relay_waiting(options.get("run_id")
                                                        or options["follow_up"]))
        try:
            result = await self.client.run_agent_tool(agent_type, input, **options)
        finally:
            relay.cancel()
            with contextlib.suppress(BaseException):
                await relay
        if getattr(result, "ok", True) is False and getattr(result, "status", None) == "aborted":
            await self._stop_if_cancelled()
        return result

    async def _stop_if_cancelled(self) -> None:
        """A nested run ended `aborted`: if that is because this run is being cancelled
        (a cancel marks a whole tree before it stops the deepest runs first), this run
        stops as well, instead of going on without the run it waited for. It waits for
        the runner to stop it, so the run ends `aborted` by the cancel. A run that is no
        longer in the log (a clear takes a tree away, deepest first) stops as well."""
        state = (await self.client.tether.read_run(self.parent, self.run_id)).state
        if state is not None and state.cancel_requested_at is None:
            return
        with contextlib.suppress(TimeoutError):
            # The runner hears of the cancel by its signal or, at the latest, its next
            # heartbeat; this bound only keeps a lost runner from holding the run.
            async with asyncio.timeout(CANCEL_NOTICE_S):
                await self.cancelled.wait()
        raise RunCancelled(f"run {self.run_id} was cancelled")

    async def _relay_waiting(self, run_id: str) -> None:
        """While an awaited nested run (or one below it) waits for a human or for tool
        output, say so in this run's progress (`phase` the reason, `data.waiting_path`
        the runs down to the paused one), so every timeline up to the root shows it; and
        say when it goes on. Best effort: a failure here never fails the run."""
        tether, owner = self.client.tether, self.as_parent()
        state, shown = None, None
        try:
            async with contextlib.aclosing(
                    tether.log.follow(tether.subjects.run_events(owner, run_id))) as events:
                async for stored in events:
                    state = evolve(state, stored.event, stored.logged_at).state
                    if state is None:
                        continue
                    here = {"agent": owner.agent, "name": owner.name, "run_id": run_id}
                    if state.paused is not None:
                        waiting: tuple[str, tuple[dict[str, str], ...]] | None = (
                            state.paused.reason, (here,))
                    else:
                        phase, below = waiting_below(
                            state.progress.phase if state.progress else None,
                            state.progress.data if state.progress else None)
                        waiting = (phase, (here, *below)) if phase else None
                    if waiting == shown:
                        continue
                    if waiting is not None:
                        await self.report_progress(
                            phase=waiting[0], persist=True,
                            message=f"{run_id} ({state.agent_type}) waits: {waiting[0]}",
                            data={"waiting_path": list(waiting[1])})
                    elif shown is not None:
                        await self.report_progress(phase="running", persist=True,
                                                   message=f"{run_id} goes on")
                    shown = waiting
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - best effort, as the docstring says
            get_logger().warning("nested.relay_failed", run_id=self.run_id, error=repr(error))
