"""The push configs' table on real Postgres: a config is held by one gateway at a time,
and only its holder moves its progress on, from where that holder saw it. A gateway whose
lease ran out and whose config another took over changes nothing."""

from eventually import eventually

from tether.adapters.postgres.push_configs import PushConfig, PushConfigs

LEASE_S = 0.3


async def test_only_the_holder_moves_a_config_on_and_a_lapsed_one_changes_nothing(
        pool, settings):
    store = PushConfigs(pool, settings.projection_schema)
    await store.prepare()
    await store.put(PushConfig(caller="desktop", task_id="t-1", config_id="default",
                               url="http://127.0.0.1:9/hook"))
    [first] = await store.claim("first", LEASE_S)
    assert await store.claim("second", LEASE_S) == []  # held
    owed = await store.owe("first", first, "TASK_STATE_WORKING", {"task": {}})
    assert owed is not None and owed.pending_id == "t-1:default:1"
    assert await store.owe("second", first, "TASK_STATE_WORKING", {}) is None
    assert await store.owe("first", first, "TASK_STATE_WORKING", {}) is None  # owes one

    async def taken_over():  # the first's lease runs out; the second takes the config
        return await store.claim("second", LEASE_S)

    [second] = await eventually(taken_over, timeout=10, interval=LEASE_S / 3)
    assert second.pending_id == owed.pending_id  # the same notification, to send again
    # The first, woken: none of its writes lands, and its lease cannot be renewed.
    assert await store.sent("first", owed, final=False) is None
    assert await store.failed("first", owed, "refused") is False
    assert await store.finish("first", owed, "gone") is False
    assert await store.renew("first", owed, LEASE_S) is False
    # The second goes on from what it read.
    sent = await store.sent("second", second, final=False)
    assert sent is not None and (sent.sent_count, sent.sent_state) == (1, "TASK_STATE_WORKING")
    assert await store.sent("second", second, final=False) is None  # sent once
    assert await store.owe("first", sent, "TASK_STATE_COMPLETED", {}) is None
    assert await store.renew("second", sent, LEASE_S) is True
    final = await store.owe("second", sent, "TASK_STATE_COMPLETED", {"task": {}})
    assert final is not None and final.pending_id == "t-1:default:2"
    done = await store.sent("second", final, final=True)
    assert done is not None and done.done
    stored = await store.get("desktop", "t-1", "default")
    assert (stored.sent_count, stored.sent_state, stored.done, stored.pending_id) == (
        2, "TASK_STATE_COMPLETED", True, None)
    assert await store.claim("first", LEASE_S) == []  # nothing left to send


async def test_a_holder_renews_all_it_holds_and_takes_more_up_to_the_limit(pool, settings):
    """However many configs a gateway holds, each scan renews them all, and takes up to
    `limit` of those nobody holds besides: one holding as many as the limit still takes
    new ones, and none of its own lapses for want of room in the scan."""
    store = PushConfigs(pool, settings.projection_schema)
    await store.prepare()
    for n in range(3):
        await store.put(PushConfig(caller="desktop", task_id=f"t-{n}", config_id="default",
                                   url="http://127.0.0.1:9/hook"))
    assert [c.task_id for c in await store.claim("first", 30, limit=2)] == ["t-0", "t-1"]
    assert sorted(c.task_id for c in await store.claim("first", 30, limit=2)) == [
        "t-0", "t-1", "t-2"]
    assert await store.claim("second", 30, limit=2) == []  # all held, all renewed
