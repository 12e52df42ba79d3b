"""`resilience.supervise` and its `Health`: a supervised loop that restarts (a lease
re-acquired each term) says `dependency.restored` only after its dependency was lost; a
loop that failed for its own reasons says `loop.failed`, then `loop.recovered`."""

import asyncio

from recorded_log import RecordedLog

from tether.resilience import Health, supervise


class Dependency:
    """A fake dependency: each term of the loop re-acquires it (and says so with
    `progressed`), then the term ends with the next of `endings` (an error raised, or
    None: the term ends quietly, as a lost lease does)."""

    def __init__(self, endings: list[BaseException | None]) -> None:
        self.endings = endings
        self.stop = asyncio.Event()

    async def term(self, progressed) -> None:
        progressed()  # re-acquired: the loop works
        if not self.endings:
            self.stop.set()
            return
        ending = self.endings.pop(0)
        if ending is not None:
            raise ending


async def supervised(endings: list[BaseException | None]) -> RecordedLog:
    log, dependency = RecordedLog(), Dependency(endings)
    await asyncio.wait_for(supervise("test", dependency.term, dependency.stop, log), 30)
    return log


async def test_only_a_lost_dependency_is_said_restored_at_a_re_acquire() -> None:
    log = await supervised([None, RuntimeError("the leader's work ended by itself"), None,
                            TimeoutError(), None])
    # Routine re-acquires say nothing; a loop that failed on its own says it recovered.
    assert log.events == ["loop.failed", "loop.recovered", "dependency.lost",
                          "dependency.restored"]
    assert log.lines[2][1]["error"] == "TimeoutError"
    assert all(fields["loop"] == "test" for _, fields in log.lines)
    assert all(fields["down_ms"] >= 0 for event, fields in log.lines
               if event in ("loop.recovered", "dependency.restored"))


async def test_a_dependency_lost_after_the_loop_failed_on_its_own_is_said_too() -> None:
    health_log = RecordedLog()
    health = Health(health_log, "test")
    health.failed(RuntimeError("bug"))
    health.failed(RuntimeError("bug"))  # said once
    health.failed(OSError("unreachable"))
    health.failed(TimeoutError())
    health.recovered()
    health.recovered()  # working already: nothing more to say
    assert health_log.events == ["loop.failed", "dependency.lost", "dependency.restored"]
