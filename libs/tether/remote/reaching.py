"""What the remote agents share: a remote that does not answer is tried again, saying so
once in the run's progress, for the agent's `unreachable_for_s`; then the run fails
naming the URL."""

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import httpx2
from mcp.shared.exceptions import MCPError

from tether.child.context import RunCancelled, RunContext
from tether.log import get_logger
from tether.resilience import Backoff, sleep_unless_stopped

T = TypeVar("T")

# The milestone of a run whose remote task is named: the parent hears of it at once.
REMOTE_TASK_MILESTONE = "remote-task"
# Answers of a server that is there but cannot serve yet.
BUSY_STATUSES = frozenset({429, 502, 503, 504})


class RemoteAgentError(Exception):
    """The remote agent failed, refused or lost the run's task: the run fails with this."""


# MCP's error for a stream the server closed before it answered (it went away mid-call).
MCP_STREAM_ENDED = -32000


def unreachable(error: BaseException) -> bool:
    """An error that says the server is not there now (not that it refused): a failed
    connection, a timeout, a busy answer, a stream cut short, anywhere in the chain of
    causes or in a group."""
    if isinstance(error, BaseExceptionGroup):
        return any(unreachable(inner) for inner in error.exceptions)
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (httpx.TransportError, httpx2.TransportError, ConnectionError,
                             TimeoutError)):
            return True
        if isinstance(seen, (httpx.HTTPStatusError, httpx2.HTTPStatusError)):
            return seen.response.status_code in BUSY_STATUSES
        if isinstance(seen, MCPError):
            return seen.code == MCP_STREAM_ENDED
        seen = seen.__cause__ or seen.__context__
    return False


def http_status(error: BaseException) -> int | None:
    """The HTTP status of an answer the server refused with, found in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, httpx.HTTPStatusError):
            return seen.response.status_code
        seen = seen.__cause__ or seen.__context__
    return None


class Reaching:
    """Calls to one remote URL for one run, each tried again while the server is not
    there, for `patience_s` in all from the first failure of a streak."""

    def __init__(self, ctx: RunContext, what: str, url: str, patience_s: float, *,
                 refused: Callable[[BaseException], str | None]) -> None:
        """`what`: the remote's kind ("A2A agent", "MCP server"); `refused`: the message a
        refusal (an error that is not `unreachable`) ends the run with, or None to raise
        the error as it is."""
        self.ctx, self.what, self.url, self.patience_s = ctx, what, url, patience_s
        self._refused = refused
        self._waiting = False

    async def call(self, operation: Callable[[], Awaitable[T]], doing: str) -> T:
        """`operation()`, tried again while the remote is unreachable."""
        backoff, since = Backoff(initial_s=0.2, max_s=5.0), None
        while True:
            try:
                result = await operation()
            except Exception as error:
                if not unreachable(error):
                    if (message := self._refused(error)) is not None:
                        raise RemoteAgentError(message) from None
                    raise
                since = since if since is not None else time.monotonic()
                if time.monotonic() - since >= self.patience_s:
                    raise RemoteAgentError(
                        f"the {self.what} at {self.url} did not answer for "
                        f"{self.patience_s:g}s ({doing}): {describe(error)}") from None
                await self.waiting(f"{doing}: {describe(error)}")
                if await sleep_unless_stopped(self.ctx.cancelled, backoff.next_delay()):
                    raise RunCancelled(f"run {self.ctx.run_id} was cancelled") from None
                continue
            await self.answered()
            return result

    async def waiting(self, why: str) -> None:
        """Say once, until it answers again, that the run waits for the remote."""
        if not self._waiting:
            self._waiting = True
            await self.ctx.report_progress(
                phase="waiting_for_remote", persist=True,
                message=f"the {self.what} at {self.url} does not answer ({why}); trying "
                        f"again for up to {self.patience_s:g}s",
                data={"url": self.url})

    async def answered(self) -> None:
        if self._waiting:
            self._waiting = False
            await self.ctx.report_progress(phase="running", persist=True,
                                           message=f"the {self.what} at {self.url} answers")


def describe(error: BaseException) -> str:
    """The innermost cause's type and message: what actually went wrong."""
    inner: BaseException = error
    while isinstance(inner, BaseExceptionGroup):
        inner = inner.exceptions[0]
    while inner.__cause__ is not None:
        inner = inner.__cause__
    return f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__


# Why a run stops for good: what it started elsewhere is stopped too (`ctx.stop_reason`).
ENDS_THE_RUN = ("cancel", "give-up")


async def cancel_remote(ctx: RunContext, what: str, url: str, task_id: str | None,
                        cancel: Callable[[], Awaitable[Any]],
                        ended: tuple[type[BaseException], ...] = ()) -> None:
    """The run is cancelled: a cancel or a give-up cancels its remote task too; an attempt
    that lost the run, or a runner stopping, leaves the task to the next attempt. A remote
    that cannot be told is said in the log (the task may go on); the run ends cancelled
    all the same. `ended`: the errors that say the task had ended already."""
    if task_id is None or ctx.stop_reason not in ENDS_THE_RUN:
        return
    try:
        await cancel()
    except ended:
        pass
    except Exception as error:  # noqa: BLE001 - said; the run's own end is what matters
        get_logger(run_id=ctx.run_id).warning(
            "remote.cancel_failed", url=url, task_id=task_id, error=describe(error),
            detail=f"the {what}'s task may go on")
