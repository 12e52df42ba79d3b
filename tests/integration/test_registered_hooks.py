"""The parent's cached view of the hook registry."""

from tether.adapters.streams import StreamSettings, key_value
from tether.delivery.registered_hooks import RegisteredHooks


async def test_a_handler_registered_after_a_refusal_is_seen_at_the_next_request(log):
    bucket = await key_value(log.jetstream, log.subjects.registry_bucket, StreamSettings())
    hooks = RegisteredHooks(bucket, ttl_s=60)
    assert not await hooks.has("Assistant", "on_done", recheck_absent=True)
    await bucket.put("hook.Assistant.on_done", b"{}")
    assert not await hooks.has("Assistant", "on_done"), "absence is cached for the deliverer"
    assert await hooks.has("Assistant", "on_done", recheck_absent=True)


async def test_a_registered_handler_is_answered_from_the_cache(log):
    bucket = await key_value(log.jetstream, log.subjects.registry_bucket, StreamSettings())
    await bucket.put("hook.Assistant.on_done", b"{}")
    hooks = RegisteredHooks(bucket, ttl_s=60)
    assert await hooks.has("Assistant", "on_done", recheck_absent=True)
    await bucket.delete("hook.Assistant.on_done")
    assert await hooks.has("Assistant", "on_done", recheck_absent=True), "within the TTL"
    assert not await RegisteredHooks(bucket, ttl_s=0).has("Assistant", "on_done")
