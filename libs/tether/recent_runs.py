"""What a process knows of the runs it has just handled, so that its next step on one of
them needs no read: a cache, and named as one, so the code that relies on it says so.

Two such layers, each bounded and least recently used out, so memory does not grow with
the runs seen:

- `RecentRuns`, the event log's: the state and last sequence of each run this process
  last read or appended to. A hint, never the truth: an append decided from it expects
  its sequence, so a run someone else moved meanwhile is refused (a conflict) and read
  again. The log writes through to it whatever it reads of a whole run or appends, and
  consults it only where the caller names it: `log.recent.update(...)`
  (`tether.ports.RecentLog`). A reader of the log that folded a run itself (a child's
  execution, from its work item) tells it what it saw with `log.recent.remember_run`.
- `RecentlyProjected`, the projector's: the projected states of the runs it last wrote,
  as committed at a checkpoint, so a batch need not load them back from the table.
  Trusted only while the table's checkpoint is that one.

Nothing here reads or writes anything: the adapters that own a layer decide when it is
consulted, and the port (`tether.ports.EventLog`) says what may rely on it.
"""

from collections import OrderedDict
from dataclasses import dataclass

from tether.contract.subjects import Subjects
from tether.domain.events import ParentRef
from tether.domain.run_state import RunState

RECENT_RUNS = 512  # runs whose state each process keeps between its own reads and appends

RunKey = tuple[str, str, str]  # parent agent, parent name, run id


@dataclass(frozen=True, slots=True)
class Recent:
    """A run as this process last saw it: its state after the message at `seq` (its
    subject's last sequence then)."""

    state: RunState | None
    seq: int


class RecentRuns:
    """The state and last sequence of the runs this process last read or appended to,
    by run subject; see the module docstring for what may rely on it."""

    def __init__(self, subjects: Subjects, size: int = RECENT_RUNS) -> None:
        self._subjects = subjects
        self._size = size
        self._runs: OrderedDict[str, Recent] = OrderedDict()

    def get(self, subject: str) -> Recent | None:
        recent = self._runs.get(subject)
        if recent is not None:
            self._runs.move_to_end(subject)
        return recent

    def remember(self, subject: str, state: RunState | None, seq: int) -> None:
        """The run on `subject` as it is after the message at `seq`, unless a later
        sequence of it is already known."""
        if self._size <= 0:
            return
        current = self._runs.get(subject)
        if current is not None and current.seq > seq:
            return  # a later append of ours already landed
        self._runs[subject] = Recent(state, seq)
        self._runs.move_to_end(subject)
        while len(self._runs) > self._size:
            self._runs.popitem(last=False)

    def remember_run(self, parent: ParentRef, run_id: str, state: RunState | None,
                     seq: int) -> None:
        """What another reader of the log knows of a run: its state after the message
        at stream sequence `seq` and everything of the run before it. Only a hint for
        the next `update`, whose append expects `seq`."""
        self.remember(self._subjects.run_events(parent, run_id), state, seq)

    def forget(self, subject: str) -> None:
        self._runs.pop(subject, None)


class RecentlyProjected:
    """The projected states of recently changed runs, as committed at `checkpoint`, so a
    batch need not load them back. Only trusted while the table's checkpoint is the one
    these states were committed with (a swapped-in rebuild, or another writer, moves
    it)."""

    def __init__(self, size: int = 1024, *, empty_at: int | None = None) -> None:
        """`empty_at`: the checkpoint of a table known to be empty (a fresh replay)."""
        self._size = size
        self._states: OrderedDict[RunKey, RunState | None] = OrderedDict()
        self.checkpoint = -1 if empty_at is None else empty_at
        # Every run of the table is here (a replay into an empty table that has not
        # evicted anything yet): a run not here is not in the table either.
        self.complete = empty_at is not None

    def valid_at(self, checkpoint: int) -> bool:
        if checkpoint != self.checkpoint:
            self.clear()
            return False
        return True

    def get(self, key: RunKey) -> "RunState | object | None":
        """The run's projected state (None: it has no row); `UNKNOWN` when not here."""
        return self._states.get(key, UNKNOWN)

    def committed(self, states: dict[RunKey, RunState | None], checkpoint: int) -> None:
        for key, state in states.items():
            self._states[key] = state
            self._states.move_to_end(key)
        while len(self._states) > self._size:
            self._states.popitem(last=False)
            self.complete = False
        self.checkpoint = checkpoint

    def clear(self) -> None:
        self._states.clear()
        self.checkpoint = -1
        self.complete = False


UNKNOWN = object()
