"""A run as a follower of the whole log knows it: its own events, then the deliveries its
parent agent's delivery ledger recorded for it in batches (`deliveries.recorded`), which a
read of the run's subject does not see."""

from collections import defaultdict

from tether.domain.events import Event, ParentRef
from tether.domain.fold import evolve
from tether.domain.run_state import RunState
from tether.ports import EventLog


async def ledger_entries(log: EventLog, parent_agent: str
                         ) -> dict[tuple[str, str], list[Event]]:
    """The parent agent's batched deliveries, by (parent name, run id), in log order."""
    entries: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for stored in await log.read_subject(log.subjects.delivery_ledger(parent_agent)):
        if stored.event is not None:
            entries[(stored.event.parent.name, stored.event.run_id)].append(stored.event)
    return entries


def with_entries(state: RunState | None, entries: list[Event]) -> RunState | None:
    for event in entries:
        if state is not None:
            state = evolve(state, event).state
    return state


async def read_run_with_ledger(log: EventLog, parent: ParentRef, run_id: str
                               ) -> RunState | None:
    """The run's state, its batched deliveries folded in."""
    state = (await log.read_run(parent, run_id)).state
    entries = await ledger_entries(log, parent.agent)
    return with_entries(state, entries.get((parent.name, run_id), []))
