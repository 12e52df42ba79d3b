"""An index of deadlines that fires each one when it falls due, at a cost in proportion
to the deadlines that are due, not to all that are open.

A binary heap keyed by due time; replacing or removing a deadline leaves its old entry
in the heap and marks it stale through a version, and stale entries are dropped when
they reach the top. `pop_due` therefore touches only entries at the top of the heap:
the due ones and at most as many stale ones as were replaced since. Stale entries far
from the top (a run signalling every second with an hour's no-progress budget leaves
one a second) are dropped all at once when they outnumber the live ones, so the heap
stays in proportion to the open deadlines.
"""

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field

COMPACT_SLACK = 1024  # stale entries tolerated beyond the live ones before a compaction


@dataclass
class IndexStats:
    popped: int = 0  # heap entries taken off the top, due or stale
    stale: int = 0


@dataclass
class DeadlineIndex:
    _heap: list[tuple[int, int, Hashable]] = field(default_factory=list)
    _current: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    _version: int = 0
    stats: IndexStats = field(default_factory=IndexStats)

    def __len__(self) -> int:
        return len(self._current)

    @property
    def entries(self) -> int:
        """Heap entries, live and stale (memory, not deadlines)."""
        return len(self._heap)

    def set(self, key: Hashable, due: int | None) -> None:
        """Schedule `key` at `due` (epoch ms), replacing its deadline; None removes it."""
        if due is None:
            if self._current.pop(key, None) is not None and \
                    len(self._heap) > 2 * len(self._current) + COMPACT_SLACK:
                self._compact()
            return
        if self._current.get(key, (None,))[0] == due:
            return
        self._version += 1
        self._current[key] = (due, self._version)
        heapq.heappush(self._heap, (due, self._version, key))
        if len(self._heap) > 2 * len(self._current) + COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        dropped = len(self._heap) - len(self._current)
        self._heap = [(due, version, key) for key, (due, version) in self._current.items()]
        heapq.heapify(self._heap)
        self.stats.stale += dropped

    def get(self, key: Hashable) -> int | None:
        entry = self._current.get(key)
        return entry[0] if entry else None

    def next_due(self) -> int | None:
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: int) -> list[tuple[Hashable, int]]:
        """Remove and return every (key, due) with due <= now, earliest first."""
        due: list[tuple[Hashable, int]] = []
        while True:
            self._drop_stale_top()
            if not self._heap or self._heap[0][0] > now:
                return due
            when, _, key = heapq.heappop(self._heap)
            self.stats.popped += 1
            del self._current[key]
            due.append((key, when))

    def _drop_stale_top(self) -> None:
        while self._heap:
            when, version, key = self._heap[0]
            if self._current.get(key) == (when, version):
                return
            heapq.heappop(self._heap)
            self.stats.popped += 1
            self.stats.stale += 1
