"""One NATS connection for an application: `async with connect() as tether: ...`."""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api as js_api
from nats.js.errors import NoStreamResponseError, NotFoundError
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from tether import tracing
from tether.adapters.denials import PublishDenied, refusal_of, unless_refused
from tether.adapters.event_log import EventLog
from tether.adapters.nats_connection import NatsRefused, connect_nats
from tether.adapters.requests import subscribe_routed
from tether.client.arguments import check_seconds
from tether.client.chat_feed import drop_chat_reader, follow_chat
from tether.client.conversation import Conversation
from tether.client.errors import (
    InputTooLarge,
    NotPermitted,
    RateLimited,
    RequestFailed,
    ServiceUnavailable,
    TetherError,
)
from tether.client.feed import OrderedFeed, ServedFeed, open_feed
from tether.client.hooks import HookRegistry
from tether.client.link import AwaitTiming, RunReads
from tether.client.parent import ParentHandle, parent_handle
from tether.client.run_events import DirectReads, ServedReads
from tether.config import Settings
from tether.contract.messages import HasRunReply, ObservabilityEvent
from tether.contract.subjects import Subjects
from tether.diagnose import nats_refused, nats_unreachable, redact
from tether.domain.chat import ChatKey
from tether.domain.commands import HasRunQuery
from tether.domain.events import ParentRef
from tether.log import get_logger
from tether.ports import RunHistory, run_history
from tether.resilience import TRANSIENT_ERRORS

if TYPE_CHECKING:
    from tether.contract.messages import ChatMessage

Reply = TypeVar("Reply", bound=BaseModel)
DEFAULT_RPC_TIMEOUT_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Fields a command leaves out while they are unset, so that a parent from before them
# (which refuses fields it does not know) takes the command.
_LEFT_OUT_UNSET = ("expires_in_ms", "max_tokens", "max_cost", "turn")
# The look whether any parent service answers (`parent_unavailable`): how long it waits
# for an answer, and how long its answer is kept.
PRESENCE_LOOK_S = 2.0
PRESENCE_KEPT_S = 5.0
# The server's answer to a JetStream request from an account without JetStream.
JS_NOT_ENABLED_FOR_ACCOUNT = 10039
# The field of each command that carries the caller's own values, for an error naming
# the one that is not JSON.
_CALLERS_VALUES = {"run": "input", "send": "data", "continue": "tool_outputs",
                   "message": "metadata"}


class Tether:
    """A client of one Tether installation (one prefix) over one NATS connection.

    Safe to share between tasks: every run, timeline and hook handler gets its own
    subscription on the same connection.

    `served`: the connection's account has no JetStream of its own, as an application in
    an account of its own (`tether.access`): stored messages are read through the parent
    service's `history` query and new ones on the live subjects the streams republish
    them on, hooks are consumed from consumers the parent makes (`tether.client.run_events`).
    `connect` finds out which by asking the server.
    """

    def __init__(self, nc: NATS, settings: Settings, *, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S,
                 served: bool = False) -> None:
        self.nc = nc
        self.settings = settings
        self.subjects: Subjects = settings.subjects
        self.log = EventLog(nc, self.subjects)
        self.js = self.log.jetstream
        self.rpc_timeout = rpc_timeout
        self.served = served
        self.run_reads: RunReads = ServedReads(self) if served else DirectReads(self.log)
        self.awaiting = AwaitTiming()
        self._answers: set[asyncio.Task] = set()
        # (when asked, on the loop's clock; the answer) of the last presence look
        self._presence: tuple[float, str | None] | None = None
        # the same of the last look at each agent type's child-runners
        self._runners: dict[str, tuple[float, str | None]] = {}

    def feed(self, stream: str, filter_subject: str, **options) -> "OrderedFeed | ServedFeed":
        """Replay-then-live reading of one filter of one of the parent feeds' streams
        (events, progress, chat); `options` as `OrderedFeed` takes them."""
        return open_feed(self, stream, filter_subject, **options)

    async def read_run(self, parent: ParentRef, run_id: str) -> RunHistory:
        """Every stored event of one run, and the state they fold to."""
        if not self.served:
            try:
                return await self.log.read_run(parent, run_id)
            except NoStreamResponseError:
                # No responders: the stream is missing, or has no leader for a moment (a
                # cluster electing one), which its callers ride out as any broker fault.
                try:
                    await self.js.stream_info(self.subjects.events_stream)
                except NotFoundError:
                    raise ServiceUnavailable(
                        f"stream {self.subjects.events_stream} does not exist: start the "
                        "Tether services (they create the streams) or check the prefix"
                    ) from None
                except TRANSIENT_ERRORS:
                    pass
                raise
        return run_history(await self.run_reads.read(self.subjects.run_events(parent, run_id)))

    async def subscribe_live(self, subject: str, route: Callable[[Msg], Any]) -> Any:
        return await subscribe_routed(self.nc, subject, route)

    def answer_present(self, msg: Msg) -> None:
        """Answer the reconciler's question whether an awaited run is still awaited."""
        if not msg.reply:
            return
        task = asyncio.ensure_future(self.nc.publish(msg.reply, b""))
        self._answers.add(task)  # referenced until sent
        task.add_done_callback(self._answers.discard)

    async def parent_unavailable(self, parent: ParentRef) -> str | None:
        """Why no parent service would take `parent`'s commands now, or None. The answer
        is kept for PRESENCE_KEPT_S, so that many requests waiting on one busy parent
        cost it one query."""
        now = asyncio.get_running_loop().time()
        if self._presence is None or now - self._presence[0] > PRESENCE_KEPT_S:
            query = HasRunQuery(run_id="presence", parent=parent)
            try:
                await self.request("has_run", query, HasRunReply, timeout=PRESENCE_LOOK_S)
                unavailable = None
            except ServiceUnavailable as error:
                unavailable = str(error)
            except TetherError:
                unavailable = None  # a parent answered, if only with a refusal
            self._presence = (now, unavailable)
        return self._presence[1]

    async def runners_unavailable(self, agent_type: str, probe: bytes) -> str | None:
        """Why no child-runner would take a run of `agent_type` now, or None. Every runner
        of the type answers its inspection subject; none subscribed is NATS's no-responders
        at once. Kept for PRESENCE_KEPT_S per agent type, like `parent_unavailable`."""
        if self.served:
            return None  # an application in an account of its own may not ask the runners
        now = asyncio.get_running_loop().time()
        kept = self._runners.get(agent_type)
        if kept is None or now - kept[0] > PRESENCE_KEPT_S:
            subject = self.subjects.inspect_child(agent_type)
            try:
                await self.nc.request(subject, probe, timeout=PRESENCE_LOOK_S)
                unavailable = None
            except nats.errors.NoRespondersError:
                unavailable = (f"no child-runner of {agent_type} runs (none answered on "
                               f"{subject})")
            except TRANSIENT_ERRORS:
                unavailable = None  # slow to answer is not absent
            kept = self._runners[agent_type] = (now, unavailable)
        return kept[1]

    def parent(self, agent: str, name: str) -> "ParentHandle":
        """The parent agent instance (`agent` class, `name` instance) runs are made for."""
        return parent_handle(self, agent, name)

    def conversation(self, agent_type: str, name: str, *,
                     owner: "ParentRef | tuple[str, str] | str | None" = None) -> "Conversation":
        """The conversation `name` with the model parent `agent_type`, owned by the parent
        instance `owner` (`(agent, name)` or `"agent/name"`: the application's user, say;
        `tether.client.conversation`). Without `owner`, the shared owner
        `Conversations/<agent_type>` of earlier versions (deprecated)."""
        return Conversation(self, agent_type, name, owner=owner)

    def hooks(self, parent_agent: str, *, lease_ms: int | None = None, concurrency: int = 8,
              ledger: Literal["parent", "direct"] = "parent") -> "HookRegistry":
        """Finish-hook handlers of one parent agent class (all its instances)."""
        return HookRegistry(self, parent_agent, lease_ms=lease_ms, concurrency=concurrency,
                            ledger=ledger)

    def chat(self, parent: "ParentHandle | ParentRef | ChatKey", *, durable: str | None = None,
             new_only: bool = False) -> AsyncIterator["ChatMessage"]:
        """Chat notifications for one parent instance (or one run's chat, a `ChatKey`);
        see `tether.client.chat_feed.follow_chat`."""
        ref = parent if isinstance(parent, ParentRef | ChatKey) else parent.ref
        return follow_chat(self, ref, durable=durable, new_only=new_only)

    async def drop_chat_reader(self, parent: "ParentHandle | ParentRef", durable: str) -> bool:
        """Delete one of the parent instance's durable chat readers (`chat(durable=)`);
        False when it had none of that name."""
        ref = parent if isinstance(parent, ParentRef) else parent.ref
        return await drop_chat_reader(self, ref, durable)

    async def observe(self, pattern: str = "agent_tool:>", *,
                      parent_agent: str | None = None) -> AsyncIterator["ObservabilityEvent"]:
        """The reconciler's typed events as they happen (`agent_tool:recovery:row`,
        `agent_tool:detached:give_up`, ...); `pattern` narrows them, e.g.
        `agent_tool:detached:>`, and `parent_agent` to one parent agent's runs (what an
        application in an account of its own is granted: it must name one). Live only:
        nothing is replayed."""
        subject = self.subjects.observing(pattern, parent_agent)
        refused_words = (f"this connection's NATS user may not observe {subject}: an "
                         "application user observes only the parent agents its "
                         "configuration lists (tether.access); name one with "
                         "observe(parent_agent=...)")
        if self.served and parent_agent is None:
            raise NotPermitted(refused_words)
        events: asyncio.Queue[bytes] = asyncio.Queue()

        async def receive(msg) -> None:
            events.put_nowait(msg.data)

        with refusal_of(self.nc, subject) as refused:
            subscription = await self.nc.subscribe(subject, cb=receive)
            try:
                while True:
                    getting = asyncio.ensure_future(events.get())
                    waiting: set[asyncio.Future[Any]] = {getting, refused}
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if not getting.done():  # refused, whenever the server said so
                        getting.cancel()
                        raise NotPermitted(refused_words)
                    yield ObservabilityEvent.model_validate_json(getting.result())
            finally:
                await subscription.unsubscribe()

    async def publish_command(self, kind: str, command: Any, msg_id: str, *,
                              stored_at: int | None = None) -> js_api.PubAck:
        # The per-parent subject: what NATS permissions grant to the parent's application.
        subject = self.subjects.command_for(kind, command.parent)
        # Unset optional fields are left out rather than written null (`_LEFT_OUT_UNSET`).
        unset = {name for name in _LEFT_OUT_UNSET if getattr(command, name, 0) is None}
        try:
            payload = command.model_dump_json(exclude=unset or None).encode()
        except PydanticSerializationError as error:
            field = _CALLERS_VALUES.get(kind, "command")
            raise TypeError(f"the {field} of the {kind} command is not JSON-serialisable "
                            f"({error}): nothing was sent") from None
        if len(payload) > self.settings.max_input_bytes or len(payload) > self.nc.max_payload:
            self._check_size(kind, command, payload)
        try:
            ack = await self.log.publish(subject, payload, headers={"Nats-Msg-Id": msg_id},
                                         stream=self.subjects.commands_stream)
            # A duplicate names the sequence of the message it repeats: ours when that is
            # where this request was stored before, else the parent is asked whose it is.
            if ack.duplicate and kind in ("run", "message", "delivered") \
                    and ack.seq != stored_at \
                    and not await self._duplicate_is_ours(kind, command, ack.seq, msg_id):
                # Another parent's command carried this id (the window is the stream's):
                # the request goes again under an id nobody else can know.
                ack = await self.log.publish(
                    subject, payload, headers={"Nats-Msg-Id": f"{msg_id}:{uuid.uuid4().hex}"},
                    stream=self.subjects.commands_stream)
            return ack
        except NoStreamResponseError:
            raise ServiceUnavailable(
                f"no stream takes {subject}: the Tether services create "
                f"it at start-up; are they running with prefix {self.subjects.prefix!r}?"
            ) from None
        except PublishDenied:
            raise NotPermitted(
                f"this connection's NATS user may not send {kind} commands for parent "
                f"{command.parent.agent}/{command.parent.name} (the server refused {subject}); "
                "an application user acts only for the parent agents its configuration "
                "lists (tether.access)") from None

    async def _duplicate_is_ours(self, kind: str, command: Any, seq: int, msg_id: str) -> bool:
        """Whether the command a run request (a user message, a delivery report) was a
        duplicate of is this parent's command with the same id, as the parent service
        reads it from the commands stream. (A message for the parent's own chat names no
        run: the parent's name stands in.)"""
        run_id = getattr(command, "run_id", None) or command.parent.name
        query = HasRunQuery(run_id=run_id, parent=command.parent, command_seq=seq,
                            command_id=msg_id, command_kind=kind)
        try:
            return (await self.request("has_run", query, HasRunReply,
                                       wait_when_limited=True)).command_ours is not False
        except ServiceUnavailable:
            return True  # the parent will handle the command when it is back: wait for it

    def _check_size(self, kind: str, command: Any, payload: bytes) -> None:
        """Refuse, before sending, a run whose input the parent would reject as too large,
        or a command the NATS server would not take (a whole command within both limits
        passes without this)."""
        limit = self.settings.max_input_bytes
        if kind == "run":
            size = input_size(command.input)
            if size > limit:
                raise InputTooLarge(f"the input is {size:,} bytes; the limit is {limit:,} "
                                    "bytes (TETHER_MAX_INPUT_BYTES)")
        server_limit = self.nc.max_payload
        if server_limit and len(payload) > server_limit:
            raise InputTooLarge(f"the {kind} command is {len(payload):,} bytes; the NATS server "
                                f"at {redact(self.settings.nats_url)} takes at most "
                                f"{server_limit:,} bytes per message (its max_payload)")

    async def request(self, kind: str, query: Any, reply_model: type[Reply], *,
                      timeout: float | None = None, subject: str | None = None,
                      wait_when_limited: bool = False) -> Reply:
        """Core request/reply with the parent service, on the query's per-parent subject
        unless `subject` is given; raises ServiceUnavailable, NotPermitted, RateLimited or
        RequestFailed. `wait_when_limited`: a query refused for asking too often is asked
        again when the parent says it may be (the client's own reads while it awaits or
        follows a run)."""
        timeout = check_seconds(timeout, "timeout")
        while True:
            try:
                return await self._request_once(kind, query, reply_model, timeout=timeout,
                                                subject=subject)
            except RateLimited as limited:
                if not wait_when_limited:
                    raise
                await asyncio.sleep(limited.retry_after_s)

    async def _request_once(self, kind: str, query: Any, reply_model: type[Reply], *,
                            timeout: float | None, subject: str | None) -> Reply:
        subject = subject or self.subjects.rpc_for(kind, query.parent)
        timeout = self.rpc_timeout if timeout is None else timeout
        try:
            message = await unless_refused(
                self.nc, subject, self.nc.request(subject, query.model_dump_json().encode(),
                                                  timeout=timeout))
        except PublishDenied:
            raise NotPermitted(
                f"this connection's NATS user may not ask {subject}: an application user "
                "acts only for the parent agents its configuration lists "
                "(tether.access)") from None
        except nats.errors.NoRespondersError:
            raise ServiceUnavailable(
                f"no parent service answers {subject}: is `tether services parent` running "
                f"with prefix {self.subjects.prefix!r}?") from None
        except nats.errors.TimeoutError:
            raise ServiceUnavailable(f"the parent service did not answer {subject} "
                                     f"within {timeout:g}s") from None
        try:
            reply = reply_model.model_validate_json(message.data)
        except ValidationError as error:
            raise RequestFailed(f"unexpected reply on {subject}: {error}") from None
        if refusal := getattr(reply, "error", None):
            if (retry_after_ms := getattr(reply, "retry_after_ms", None)) is not None:
                raise RateLimited(f"{subject}: {refusal}", retry_after_ms / 1000)
            raise RequestFailed(f"{subject}: {refusal}")
        return reply

    async def close(self) -> None:
        """Drain the connection; one that is reconnecting (its server away) has nothing
        to drain and is closed."""
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except nats.errors.ConnectionReconnectingError:
            await self.nc.close()


def input_size(input: object) -> int:
    """A run input's size as the parent measures it: compact JSON, in bytes."""
    return len(json.dumps(input, separators=(",", ":")).encode())


class _Connection:
    """What `connect` returns: use it with `async with`, or `await` it and `close()` later."""

    def __init__(self, settings: Settings, name: str, inbox_prefix: str | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        check_seconds(connect_timeout, "connect_timeout", none_allowed=False)
        self._settings = settings
        self._name = name
        self._options: dict[str, Any] = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
        self._connect_timeout = connect_timeout
        self._tether: Tether | None = None

    async def _open(self) -> Tether:
        url = self._settings.nats_url
        failures: list[BaseException] = []
        connected = False
        logger = get_logger(component="client", nats_url=redact(url))

        # nats-py tries the first connection again and again once reconnecting is on (it
        # is, for later outages): the timeout ends that, with the last reason it gave.
        said: list[str] = []

        async def on_error(error: BaseException) -> None:
            if not connected:
                failures.append(error)
                return
            # One line per change, not per attempt (a reconnect loop tries twice a second).
            text = str(error) or type(error).__name__
            if not said or said[-1] != text:
                said.append(text)
                logger.warning("nats.error", error=text)

        async def on_reconnected() -> None:
            said.clear()
            logger.info("nats.reconnected")

        try:
            async with asyncio.timeout(self._connect_timeout):
                nc = await connect_nats(self._settings.nats_connect_url, name=self._name,
                                        startup_timeout_s=None, error_cb=on_error,
                                        reconnected_cb=on_reconnected,
                                        **self._settings.nats_options(), **self._options)
        except TimeoutError:
            why = (str(failures[-1]) or type(failures[-1]).__name__ if failures
                   else f"no answer within {self._connect_timeout:g} s")
            raise ServiceUnavailable(nats_unreachable(url, why)) from None
        except NatsRefused as error:
            raise ServiceUnavailable(nats_refused(url, error, self._settings.nats_credentials())
                                     ) from None
        except (OSError, nats.errors.Error) as error:
            raise ServiceUnavailable(nats_unreachable(url, error)) from None
        connected = True
        # The application's tracer provider, or one the OTEL_* variables ask for.
        tracing.configure(self._name)
        try:
            served = await _account_without_jetstream(nc)
        except BaseException:
            await nc.close()
            raise
        self._tether = Tether(nc, self._settings, served=served)
        return self._tether

    def __await__(self):
        return self._open().__await__()

    async def __aenter__(self) -> Tether:
        return await self._open()

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tether is not None:
            await self._tether.close()


async def _account_without_jetstream(nc: NATS) -> bool:
    """Whether the server says JetStream is not enabled for this connection's account:
    an application in an account of its own (`tether.access`)."""
    try:
        reply = await unless_refused(nc, "$JS.API.INFO", nc.request(
            "$JS.API.INFO", b"", timeout=DEFAULT_RPC_TIMEOUT_S))
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, PublishDenied):
        return False
    with suppress(ValueError, AttributeError):
        return json.loads(reply.data).get("error", {}).get("err_code") == JS_NOT_ENABLED_FOR_ACCOUNT
    return False


def connect(nats_url: str | None = None, *, prefix: str | None = None,
            settings: Settings | None = None, name: str = "tether-client",
            inbox_prefix: str | None = None,
            connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> _Connection:
    """Connect to Tether; defaults come from `TETHER_NATS_URL` and `TETHER_PREFIX`.

    `settings` (a `tether.config.Settings`) replaces the environment; `nats_url` and
    `prefix` override either. `inbox_prefix` (e.g. `_INBOX_<user>`) is where replies come
    back. An application whose NATS account has no JetStream of its own (an account per
    application, `tether.access`) reads through the parent service (`Tether(served=True)`).
    `connect_timeout`: how long to try the first connection before `ServiceUnavailable`
    names the server it could not reach; once connected, the client reconnects on its own.
    """
    overrides: dict[str, Any] = {key: value for key, value in (("nats_url", nats_url), ("prefix", prefix))
                 if value is not None}
    if settings is None:
        settings = Settings.from_env(**overrides)
    elif overrides:
        settings = Settings(**{**settings.model_dump(), **overrides})
    return _Connection(settings, name, inbox_prefix, connect_timeout)

