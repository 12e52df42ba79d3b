"""Handing the parent's steering messages to a running child: what the run's log holds
that the child has not had goes to its context (`RunContext.offer`), one look at a time,
and a look asked for while one is under way is made again after it."""

import asyncio

from tether.child.context import RunContext, RunSuperseded
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState
from tether.log import get_logger
from tether.ports import EventLog


class MessageHanding:
    def __init__(self, log: EventLog, parent: ParentRef, run_id: str) -> None:
        self._log, self._parent, self._run_id = log, parent, run_id
        self._ctx: RunContext | None = None
        self._incarnation = ""
        self._looking: asyncio.Task[None] | None = None
        self._look_again = False

    def start(self, ctx: RunContext, incarnation: str) -> None:
        """The child's context exists: a look asked for before it is made now."""
        self._ctx, self._incarnation = ctx, incarnation
        if self._look_again:  # a message's signal came while the attempt prepared
            self.look()

    def look(self, state: RunState | None = None) -> None:
        """The run has a message for its child (its signal came, or `state`, a heartbeat's
        read, holds one the child has not had): hand it over from `state` or a read."""
        if self._ctx is None or (self._looking is not None and not self._looking.done()):
            self._look_again = True
            return
        self._looking = asyncio.ensure_future(self._hand(self._ctx, state))

    def stop(self) -> None:
        if self._looking is not None:
            self._looking.cancel()

    async def _hand(self, ctx: RunContext, state: RunState | None) -> None:
        try:
            while True:
                self._look_again = False
                if state is None:
                    state = (await self._log.read_run(self._parent, self._run_id)).state
                if state is not None and state.incarnation == self._incarnation:
                    await ctx.offer(state.waiting_messages)
                if not self._look_again:
                    return
                state = None
        except RunSuperseded:
            return  # the attempt lost the run: it is being stopped
        except Exception as error:  # noqa: BLE001 - the next heartbeat looks again
            get_logger(run_id=self._run_id).warning("run.messages_not_handed", error=repr(error))
