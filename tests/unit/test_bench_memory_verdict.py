"""The benchmark's memory verdict: sustained growth per finished run, not one step."""

import pytest

from bench.report import memory_verdict

MIB = 1024


def samples(half: float, three_quarters: float | None, end: float) -> dict:
    taken = {"half": {"VmRSS": int(half * MIB)}, "end": {"VmRSS": int(end * MIB)}}
    if three_quarters is not None:
        taken["three_quarters"] = {"VmRSS": int(three_quarters * MIB)}
    return {"service": taken}


@pytest.mark.parametrize(("rss", "grows"), [
    ((60.0, 60.2, 60.3), False),   # flat
    ((60.0, 63.5, 63.6), False),   # one step: arenas kept after a burst
    ((60.0, 60.1, 63.5), False),   # one step, later
    ((60.0, 61.6, 63.2), True),    # 1.3 MiB per 1k runs at N = 5,000, all the way
    ((60.0, 62.0, 64.5), True),
    ((60.0, None, 62.5), True),    # no 3N/4 sample: more than 2 MiB over the half
    ((60.0, None, 61.5), False),
])
def test_growth_must_hold_through_both_quarters(rss, grows):
    verdict = memory_verdict(samples(*rss), finished=5000)["service"]
    assert verdict["grows"] is grows
    assert verdict["growth_kib"] == int(rss[2] * MIB) - int(rss[0] * MIB)
