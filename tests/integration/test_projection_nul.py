"""NUL characters in a run's strings: Postgres text and jsonb cannot hold them, so the
projection stores U+FFFD in their place, and the runs after them are projected."""

import json
import logging

import structlog
from projecting import run_projector_until

from tether.adapters.postgres.projector import rebuild, verify
from tether.contract.codec import encode_event
from tether.testing import RunEvents

REPLACED = "\ufffd"
# A backslash and "u0000" typed by a user: what the JSON text of a NUL looks like, but no NUL.
LITERAL = "a\\u0000b"


async def append_runs_carrying_nul(log) -> int:
    """A completed run and a failed one whose strings carry NUL, a message that cannot
    be decoded and whose error quotes one, then a plain run; returns the last sequence."""
    done, failed, after = RunEvents("nul-done"), RunEvents("nul-failed"), RunEvents("after-nul")
    for event in (
        done.requested(input={"note": "a\x00b", "literal": LITERAL, "k\x00": ["\x00"]}),
        done.running(),
        done.milestone("step-one", data={"text": "x\x00y", "literal": LITERAL}),
        done.completed("sum\x00mary", output={"out": "o\x00"}),
        failed.requested(input={"q": "\x00"}),
        failed.failed("boom\x00"),
    ):
        await log.append(event, expected_last_seq=None)
    poison = json.loads(encode_event(RunEvents("nul-poison").requested()))
    await log.jetstream.publish(log.subjects.run_events(done.parent, "nul-poison"),
                                json.dumps({**poison, "data": {**poison["data"], "x\x00": 1}})
                                .encode())
    last = 0
    for event in (after.requested(), after.completed("after")):
        last = await log.append(event, expected_last_seq=None)
    return last


async def test_a_run_carrying_nul_is_projected_with_u_fffd_and_the_runs_after_it_too(
        log, pool, settings):
    schema = settings.projection_schema
    last = await append_runs_carrying_nul(log)
    await run_projector_until(pool, log, schema, last, timeout=30)

    runs = {r["run_id"]: r for r in await pool.fetch(
        f'SELECT run_id, status, summary, error, output::text, state::text, input_preview '
        f'FROM "{schema}".runs')}
    assert set(runs) == {"nul-done", "nul-failed", "after-nul"}
    assert runs["after-nul"]["status"] == "completed"
    done = runs["nul-done"]
    assert done["status"] == "completed"
    assert done["summary"] == f"sum{REPLACED}mary"
    assert json.loads(done["output"]) == {"out": f"o{REPLACED}"}
    state = json.loads(done["state"])
    assert state["input"] == {"note": f"a{REPLACED}b", "literal": LITERAL,
                              f"k{REPLACED}": [REPLACED]}
    assert LITERAL in done["input_preview"]
    assert runs["nul-failed"]["error"] == f"boom{REPLACED}"
    milestone = await pool.fetchrow(f'SELECT name, data::text FROM "{schema}".milestones '
                                    f"WHERE run_id = 'nul-done'")
    assert milestone["name"] == "step-one"
    assert json.loads(milestone["data"]) == {"text": f"x{REPLACED}y", "literal": LITERAL}
    dead = await pool.fetch(f'SELECT error_kind, error FROM "{schema}".dead_letters')
    assert [r["error_kind"] for r in dead] == ["invalid"]
    assert f"unknown field `x{REPLACED}`" in dead[0]["error"]


async def test_a_replay_of_runs_carrying_nul_equals_the_live_projection(log, pool, settings):
    """The live projector upserts each run from its state document; a bulk replay copies
    the columns Python computed: both store U+FFFD, so `verify` finds no difference."""
    schema = settings.projection_schema
    last = await append_runs_carrying_nul(log)
    await run_projector_until(pool, log, schema, last, timeout=30, batch_size=2)

    assert (await verify(pool, log, schema)).differences == []
    assert (await verify(pool, log, schema, batch_size=3)).differences == []
    report = await rebuild(pool, log, schema)
    assert report.checkpoint == last
    summary = await pool.fetchval(f'SELECT summary FROM "{schema}".runs '
                                  f"WHERE run_id = 'nul-done'")
    assert summary == f"sum{REPLACED}mary"
    assert (await verify(pool, log, schema)).differences == []


async def test_a_batch_that_fails_is_named_by_its_first_and_last_sequence(log, pool, settings):
    run = RunEvents("named")
    first = await log.append(run.requested(), expected_last_seq=None)
    last = await log.append(run.completed(), expected_last_seq=None)
    failures = iter([ValueError("this batch cannot be written")])

    async def fail_once(batch) -> None:
        if (error := next(failures, None)) is not None:
            raise error

    lines = structlog.testing.LogCapture()
    logger = structlog.wrap_logger(None, processors=[lines],
                                   wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    await run_projector_until(pool, log, settings.projection_schema, last, timeout=30,
                              logger=logger, before_commit=fail_once)
    failed = [line for line in lines.entries if line["event"] == "projector.batch_failed"]
    assert [(line["first_seq"], line["last_seq"]) for line in failed] == [(first, last)]
    assert "ValueError: this batch cannot be written" in failed[0]["error"]
