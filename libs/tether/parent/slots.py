"""The per-parent concurrency cap (`max_concurrent_agent_tools`).

The open runs of each parent are kept in a NATS KV entry, updated with compare-and-set
on the entry's revision, so that concurrent requests on any number of parent replicas
never admit more than the cap. The entry is a cache of the log, not the truth: when a
parent is at its cap, each listed run is looked up in the log and the ones that are no
longer starting or running (finished, interrupted, cleared, or never created because the
process died after taking the slot) are dropped before deciding.
"""

import json
from dataclasses import dataclass

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tether.domain.events import ParentRef
from tether.ports import EventLog

# A slot taken this recently is kept even if its run is not in the log yet: the parent
# that took it may be about to append `run.requested`.
FRESH_SLOT_MS = 30_000


@dataclass(frozen=True)
class SlotDecision:
    admitted: bool
    open_runs: int


class SlotKeeper:
    def __init__(self, kv: KeyValue, log: EventLog) -> None:
        self._kv = kv
        self._log = log

    @staticmethod
    def _key(parent: ParentRef) -> str:
        """`<agent>.<name>`, every `:` as `=` (a KV key has no `:`; `=` is in no
        identifier): a run acting as a parent is named `<run id>:<digest>`."""
        return f"{parent.agent}.{parent.name}".replace(":", "=")

    async def acquire(self, parent: ParentRef, run_id: str, cap: int, now: int) -> SlotDecision:
        key = self._key(parent)
        while True:
            slots, revision = await self._read(key)
            if run_id in slots:
                return SlotDecision(True, len(slots))
            if len(slots) >= cap:
                slots = await self._still_open(parent, slots, now)
            if len(slots) >= cap:
                return SlotDecision(False, len(slots))
            slots[run_id] = now
            if await self._write(key, slots, revision):
                return SlotDecision(True, len(slots))

    async def release(self, parent: ParentRef, run_id: str) -> None:
        key = self._key(parent)
        while True:
            slots, revision = await self._read(key)
            if run_id not in slots:
                return
            del slots[run_id]
            if await self._write(key, slots, revision):
                return

    async def _read(self, key: str) -> tuple[dict[str, int], int | None]:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return {}, None
        if not entry.value:
            return {}, entry.revision
        return dict(json.loads(entry.value)), entry.revision

    async def _write(self, key: str, slots: dict[str, int], revision: int | None) -> bool:
        value = json.dumps(slots, sort_keys=True).encode()
        try:
            if revision is None:
                await self._kv.create(key, value)
            else:
                await self._kv.update(key, value, last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _still_open(self, parent: ParentRef, slots: dict[str, int],
                          now: int) -> dict[str, int]:
        kept = {}
        for run_id, taken_at in slots.items():
            state = (await self._log.read_run(parent, run_id)).state
            if ((state is not None and state.is_open)
                    or (state is None and now - taken_at < FRESH_SLOT_MS)):
                kept[run_id] = taken_at
        return kept
