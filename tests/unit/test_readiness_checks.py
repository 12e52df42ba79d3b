"""Readiness as the services' health server and the UI answer it: every check is asked,
and one that raises, answers wrongly or hangs past its 2 s is "not ready", with why."""

import asyncio

from tether.runtime import HealthServer, run_checks


async def ok():
    return True, "connected"


async def down():
    return False, "not connected"


async def raises():
    raise ConnectionError("refused")


async def malformed():
    return ("yes",)


async def hangs():
    await asyncio.Event().wait()


async def test_every_check_is_asked_and_a_failure_is_an_answer():
    answers = await run_checks({"nats": ok, "postgres": down, "broken": raises,
                                "odd": malformed})
    assert answers == {"nats": (True, "connected"), "postgres": (False, "not connected"),
                       "broken": (False, "ConnectionError: refused"),
                       "odd": (False, "ValueError: not enough values to unpack (expected 2, got 1)")}


async def test_a_check_that_hangs_answers_not_ok_after_two_seconds():
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await run_checks({"stuck": hangs, "nats": ok}) == {
        "stuck": (False, "TimeoutError: "), "nats": (True, "connected")}
    assert 2.0 <= loop.time() - started < 3.0


async def test_the_health_server_says_each_check_and_is_ready_only_when_all_are():
    assert await HealthServer("127.0.0.1", 0, {"nats": ok, "postgres": ok}).readiness() == (
        True, {"nats": "ok: connected", "postgres": "ok: connected"})
    assert await HealthServer("127.0.0.1", 0, {"nats": ok, "postgres": down}).readiness() == (
        False, {"nats": "ok: connected", "postgres": "failing: not connected"})
    assert await HealthServer("127.0.0.1", 0, {}).readiness() == (
        False, {"service": "failing: starting (not connected yet)"})
