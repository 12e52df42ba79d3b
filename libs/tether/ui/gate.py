"""Which parents the UI may show: what its NATS user may read, asked of the server.

An application user of `tether.access` may read the events of its own parent agents
only; the UI asks the server once per parent agent (a last-message request on a subject
of that agent, which the permissions allow or refuse) and remembers the answer. The
operator, or a server without users, may read everything. A parent the UI may not read
is treated as one that does not exist (404): a drill-in never tells whether it exists.
"""

import asyncio

from tether.adapters.jetstream import EventLog, PublishDenied
from tether.domain.events import ParentRef

PROBE_NAME = "ui-access-probe"


class AccessGate:
    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._agents: dict[str, bool] = {}
        self._lock = asyncio.Lock()

    async def may_read(self, agent: str) -> bool:
        if (known := self._agents.get(agent)) is not None:
            return known
        async with self._lock:
            if agent not in self._agents:
                probe = ParentRef(agent=agent, name=PROBE_NAME)
                try:
                    await self._log.last_seq_of(self._log.subjects.run_events(probe, PROBE_NAME))
                    self._agents[agent] = True
                except PublishDenied:
                    self._agents[agent] = False
        return self._agents[agent]

    async def readable(self, agents: set[str]) -> set[str]:
        return {agent for agent in sorted(agents) if await self.may_read(agent)}
