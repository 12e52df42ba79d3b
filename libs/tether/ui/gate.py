"""Which parents the UI may show: what its NATS user may read, asked of the server.

An application of `tether.access` may read the events of its own parent agents only;
the UI asks once per parent agent (a read of a run of that agent, which the server's
permissions allow or refuse) and remembers the answer. The
operator, or a server without users, may read everything. A parent the UI may not read
is treated as one that does not exist (404): a drill-in never tells whether it exists.
"""

import asyncio
from typing import TYPE_CHECKING

from tether.adapters.denials import PublishDenied
from tether.client.errors import NotPermitted
from tether.domain.events import ParentRef

if TYPE_CHECKING:
    from tether.client.connection import Tether

PROBE_NAME = "ui-access-probe"


class AccessGate:
    def __init__(self, tether: "Tether") -> None:
        self._tether = tether
        self._agents: dict[str, bool] = {}
        self._lock = asyncio.Lock()

    async def may_read(self, agent: str) -> bool:
        if (known := self._agents.get(agent)) is not None:
            return known
        async with self._lock:
            if agent not in self._agents:
                probe = ParentRef(agent=agent, name=PROBE_NAME)
                try:
                    await self._tether.run_reads.last_seq(
                        self._tether.subjects.run_events(probe, PROBE_NAME))
                    self._agents[agent] = True
                except (PublishDenied, NotPermitted):
                    self._agents[agent] = False
        return self._agents[agent]

    async def readable(self, agents: set[str]) -> set[str]:
        return {agent for agent in sorted(agents) if await self.may_read(agent)}
