"""When the live projector analyzes `runs`: after a fixed number of new rows, then after
the table grew by a share of what it had when last analyzed."""

from tether.adapters.postgres.projector import (
    ANALYZE_AFTER_GROWTH,
    ANALYZE_AFTER_ROWS,
    _RunsStatistics,
)


def test_a_table_grown_from_empty_is_analyzed_after_the_first_rows() -> None:
    statistics = _RunsStatistics()
    statistics.analyzed_at(-1)  # never analyzed
    assert not statistics.grew(ANALYZE_AFTER_ROWS - 1)
    assert statistics.grew(1)


def test_a_large_table_is_analyzed_again_once_it_grew_by_its_share() -> None:
    statistics = _RunsStatistics()
    rows = 100 * ANALYZE_AFTER_ROWS
    statistics.analyzed_at(rows)
    due = int(rows * ANALYZE_AFTER_GROWTH)
    assert not statistics.grew(due - 1)
    assert statistics.grew(1)
    statistics.analyzed_at(rows + due)
    assert not statistics.grew(ANALYZE_AFTER_ROWS), "counted again from the new analysis"
