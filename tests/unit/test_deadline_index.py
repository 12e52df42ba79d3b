"""The reconciler's deadline index: due order, replacement, and cost per tick."""

import random

from tether.reconciler.deadlines import DeadlineIndex


def test_deadlines_come_out_when_due_and_earliest_first() -> None:
    index = DeadlineIndex()
    index.set("b", 20)
    index.set("a", 10)
    index.set("c", 30)
    assert index.next_due() == 10
    assert index.pop_due(9) == []
    assert index.pop_due(20) == [("a", 10), ("b", 20)]
    assert index.next_due() == 30 and len(index) == 1


def test_a_replaced_deadline_fires_only_at_its_new_time() -> None:
    index = DeadlineIndex()
    index.set("run", 10)
    index.set("run", 50)  # a progress signal moved the no-progress deadline
    assert index.pop_due(10) == []
    assert index.next_due() == 50
    index.set("run", None)  # the run ended
    assert index.next_due() is None and index.pop_due(10**12) == []


def test_a_tick_costs_in_proportion_to_the_due_runs_not_to_all_open_runs() -> None:
    index = DeadlineIndex()
    rng = random.Random(7)
    now = 1_000_000
    for i in range(100_000):
        index.set(("run", i), now + 60_000 + rng.randrange(24 * 3_600_000))
    for i in range(25):
        index.set(("due", i), now - i)
    before = index.stats.popped

    due = index.pop_due(now)

    assert sorted(key for key, _ in due) == sorted(("due", i) for i in range(25))
    assert index.stats.popped - before == 25, "only the due entries were touched"
    assert len(index) == 100_000


def test_stale_entries_are_dropped_lazily_and_counted() -> None:
    index = DeadlineIndex()
    for i in range(1_000):
        index.set(i, 100 + i)
    for i in range(1_000):
        index.set(i, 10_000 + i)  # every deadline moved later
    assert index.pop_due(5_000) == []
    assert index.stats.stale == 1_000
    assert len(index.pop_due(10_999)) == 1_000


def test_the_heap_stays_in_proportion_to_the_open_deadlines() -> None:
    index = DeadlineIndex()
    hour = 3_600_000
    for second in range(20_000):  # 50 runs, each signalling 400 times: far-off deadlines move
        index.set(("run", second % 50), second * 1_000 + hour)
    for run in range(10_000):  # runs that opened and ended
        index.set(("ended", run), hour)
        index.set(("ended", run), None)
    assert len(index) == 50
    assert index.entries <= 2 * 50 + 1_024 + 1
    due = index.pop_due(10**12)
    assert sorted(key for key, _ in due) == [("run", i) for i in range(50)]
    assert dict(due)[("run", 49)] == 19_999 * 1_000 + hour, "the latest deadline won"
