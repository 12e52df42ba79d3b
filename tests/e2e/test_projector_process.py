"""The projector service as a process: killed mid-batch, restarted, rebuilt, verified."""

import asyncio
import os
import signal
import sys

from service_processes import http_get

from tether.adapters.postgres.projector import verify
from tether.testing import append_finished_runs
from tether_services.projector import KILL_AT_SEQ_VARIABLE


async def checkpoint(pool, schema: str) -> int:
    return await pool.fetchval(
        f'SELECT coalesce(max(last_seq), 0) FROM "{schema}".checkpoints') or 0


async def wait_for_checkpoint(pool, schema: str, seq: int, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if await checkpoint(pool, schema) >= seq:
                return
        except Exception as error:  # the schema may not exist yet
            if "does not exist" not in str(error):
                raise
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the projector did not reach sequence {seq} in {timeout}s")
        await asyncio.sleep(0.05)


async def projected_counts(pool, schema: str) -> tuple[int, int, int, int]:
    row = await pool.fetchrow(
        f'SELECT count(*) AS runs, coalesce(sum(events_applied), 0) AS events, '
        f'coalesce(sum(output_chunks), 0) AS chunks FROM "{schema}".runs')
    milestones = await pool.fetchval(f'SELECT count(*) FROM "{schema}".milestones')
    return row["runs"], row["events"], row["chunks"], milestones


async def test_a_projector_killed_mid_batch_resumes_without_loss_or_double_counting(
        log, pool, services, settings):
    schema = settings.projection_schema
    total = await append_finished_runs(log, 300, milestones=2, outputs=3)  # 9 events a run
    assert total == 2700

    doomed = await services("projector", TETHER_PROJECTOR_BATCH_SIZE="400",
                            **{KILL_AT_SEQ_VARIABLE: "1500"})
    assert await doomed.wait() == -signal.SIGKILL
    reached = await checkpoint(pool, schema)
    assert reached < 1500, "the batch holding the fatal sequence never committed"
    _, events, _, _ = await projected_counts(pool, schema)
    assert events == reached, "the tables hold exactly the events up to the checkpoint"

    survivor = await services("projector", TETHER_PROJECTOR_BATCH_SIZE="400")
    await wait_for_checkpoint(pool, schema, total)
    assert await projected_counts(pool, schema) == (300, total, 300 * 3, 300 * 2)

    status, body = await http_get(survivor.health_port, "/readyz")
    assert status == 200 and body["ready"], body
    assert (await http_get(survivor.health_port, "/healthz"))[0] == 200

    survivor.signal(signal.SIGTERM)
    assert await survivor.wait() == 0
    assert any(line.get("event") == "service.stopped" for line in survivor.lines)


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tether.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode, out.decode(), err.decode()


async def test_cli_rebuild_while_the_projector_serves_and_verify_detects_drift(
        log, pool, services, settings, service_env):
    schema = settings.projection_schema
    total = await append_finished_runs(log, 200)
    projector = await services("projector")
    await wait_for_checkpoint(pool, schema, total)

    code, out, err = await run_cli(service_env, "projections", "rebuild")
    assert code == 0, err
    assert f"up to sequence {total}" in out
    assert "runs" in out and "200 rows" in out and "md5" in out
    assert "events/s" in err, "rebuild prints its progress"

    more = await append_finished_runs(log, 10, id_prefix="later")
    await wait_for_checkpoint(pool, schema, total + more)
    code, out, err = await run_cli(service_env, "projections", "verify")
    assert code == 0, err
    assert "identical" in out

    await pool.execute(f'DELETE FROM "{schema}".milestones WHERE run_id = $1', "run-7")
    code, out, err = await run_cli(service_env, "projections", "verify")
    assert code == 1
    assert "DIFFERENT: milestones" in err
    projector.signal(signal.SIGTERM)
    assert await projector.wait() == 0


async def test_a_wrong_setting_stops_the_cli_with_a_message_naming_it(service_env):
    code, _, err = await run_cli({**service_env, "TETHER_STREAM_REPLICAS": "seven"},
                                 "projections", "verify")
    assert code == 2
    assert "TETHER_STREAM_REPLICAS='seven'" in err


LEASE_HOLDER_PID = """
    SELECT pid FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND objid = (hashtext($1)::bigint & 4294967295)::oid
"""


async def test_a_projector_paused_past_its_lease_commits_nothing_on_it(
        log, pool, services, settings):
    """The projector stopped (SIGSTOP) while events arrive, and woken with its lease's
    session stalled (the backend stopped: a confirmation hangs until its time limit, as
    on a network cut). Its next batch is written but not committed: the gate before the
    commit finds the lease stale and cannot confirm it. Once the session answers again,
    it leads anew and the projection equals a replay."""
    schema = settings.projection_schema
    first = await append_finished_runs(log, 1, id_prefix="before")
    projector = await services("projector")
    await wait_for_checkpoint(pool, schema, first)
    [backend] = [row["pid"] for row in await pool.fetch(
        LEASE_HOLDER_PID, f"tether-projector:{schema}")]
    projector.signal(signal.SIGSTOP)
    stalled = False
    try:
        total = first + await append_finished_runs(log, 3, id_prefix="during")
        await asyncio.sleep(0.5)  # the fault: a pause past the check interval (200 ms)
        os.kill(backend, signal.SIGSTOP)  # a database on this machine (devstack's)
        stalled = True
    finally:
        projector.signal(signal.SIGCONT)
    try:
        await projector.logged("leadership.lost")
        assert await checkpoint(pool, schema) == first, "a batch committed on a stale lease"
    finally:
        if stalled:
            os.kill(backend, signal.SIGCONT)
    await wait_for_checkpoint(pool, schema, total)
    assert (await verify(pool, log, schema)).differences == []
