"""How a hook handler holds, calls and reports one finish hook (`tether.client.hooks`
consumes them): the message it holds while it handles it, the function called (a plain one
in a worker thread), and the delivery reports sent to the parent service together."""

import asyncio
import contextvars
import inspect
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from nats.aio.msg import Msg

from tether.adapters.holds import Hold
from tether.client.errors import ServiceUnavailable
from tether.client.link import Link
from tether.contract.messages import LifecycleResult, RunInfo
from tether.domain.commands import DeliveredCommand, DeliveryReport
from tether.resilience import Persisting

HookFunction = Callable[[RunInfo, LifecycleResult], Awaitable[object] | object]
# A delivery report waits this long for others to share its `delivered` command. Only the
# hook message's acknowledgement waits for the report, never a call of a function.
REPORT_LINGER_S = 0.005
REPORTS_PER_COMMAND = 64  # at most MAX_DELIVERY_REPORTS


class RecentKeys:
    """A bounded set, oldest out first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._size:
            self._keys.popitem(last=False)


class HeldHook:
    """A hook message as this handler holds it while it handles it: settled through its
    newest delivery, and marked in the deliveries bucket while its function runs.

    The server hands a message again to the handler holding it when a renewal came late
    (the process was paused, an in-progress acknowledgement was lost): that delivery is
    the one the server now waits on, so the handling goes on with it (`adopt`), rather
    than putting it back for another replica to call while the function still runs."""

    def __init__(self, msg: Msg, hold: Hold | None) -> None:
        self.msg, self.hold = msg, hold
        self.calling = False  # the function is running: its mark is renewed
        # Its first delivery of its first publication: marked only once its call runs
        # long (the renewals), so a call that ends soon costs no write of a mark.
        self.first = False

    def adopt(self, msg: Msg, hold: Hold | None) -> None:
        self.msg = msg
        if self.hold is not None and hold is not None:
            self.hold.confirmed(hold.renewed_at)


class DeliveryReports:
    """Delivery reports on their way to the parent service, sent together.

    The first report waiting starts a batch; `REPORT_LINGER_S` later, the batch goes out
    as one `delivered` command (those after the first in its `more`), published until the
    commands stream has it, and every report in it is then sent. A batch of one is the
    plain command, with the id it always had. One parent agent's reports: the subject
    names the first one's parent, and admits every parent of its agent."""

    def __init__(self, tether: Link, logger) -> None:
        self._tether = tether
        self._logger = logger
        self._waiting: list[tuple[DeliveryReport, asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def send(self, report: DeliveryReport) -> None:
        """Return once the report is in the commands stream; raise what publishing it
        raised that is not transient (`NotPermitted`, say)."""
        sent = asyncio.get_running_loop().create_future()
        self._waiting.append((report, sent))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_waiting())
        await sent

    async def _send_waiting(self) -> None:
        await asyncio.sleep(REPORT_LINGER_S)
        while self._waiting:
            batch = self._waiting[:REPORTS_PER_COMMAND]
            del self._waiting[:REPORTS_PER_COMMAND]
            outcome: BaseException | None = None
            try:
                await self._publish([report for report, _ in batch])
            except BaseException as error:  # noqa: BLE001 - each waiting report raises it
                outcome = error
            if isinstance(outcome, asyncio.CancelledError):
                # The loop is closing: so is every hook waiting here, in this batch or the
                # next (a future already done stays as it is).
                for _, sent in (*batch, *self._waiting):
                    sent.cancel()
                self._waiting.clear()
                raise outcome
            for _, sent in batch:
                if sent.done():
                    continue  # its hook's handling was cancelled
                if outcome is None:
                    sent.set_result(None)
                else:
                    sent.set_exception(outcome)

    async def _publish(self, reports: list[DeliveryReport]) -> None:
        command = DeliveredCommand.of(reports)
        parent = f"{command.parent.agent}.{command.parent.name}"
        if len(reports) == 1:
            msg_id = f"delivered:{parent}:{command.method}:{command.message_id}"
        else:  # one id for every attempt at this batch, and no other's
            msg_id = f"delivered:{parent}:batch:{uuid.uuid4().hex}"
        # (A stream without responders is a cluster electing its leader, here: the
        # commands stream existed when this handler started.)
        async for attempt in Persisting("hooks.ledger", lambda: self._logger,
                                        also=(ServiceUnavailable,)):
            with attempt:
                await self._tether.publish_command("delivered", command, msg_id)


async def call_hook(function: HookFunction, run: RunInfo, result: LifecycleResult,
                  threads: ThreadPoolExecutor | None) -> object:
    """What the function returns. A plain function runs in a worker thread (of `threads`,
    else the loop's default executor): one that blocks (a synchronous client, a long
    computation) would stop the loop, and with it the renewals of its hook, which the
    server would then hand to another replica to call again while the first call runs
    (and every other hook and fetch of this handler)."""
    if (inspect.iscoroutinefunction(function)
            or inspect.iscoroutinefunction(type(function).__call__)):  # an async __call__
        return function(run, result)
    call = partial(contextvars.copy_context().run, function, run, result)  # as to_thread
    return await asyncio.get_running_loop().run_in_executor(threads, call)
