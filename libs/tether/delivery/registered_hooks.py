"""Which hook handlers the applications registered (the TETHER_REGISTRY bucket), read
through a short-lived cache: every detached run with `on_finish` asks at its request,
and every finished run asks for the parent's global hook."""

import time

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

TTL_S = 2.0


class RegisteredHooks:
    def __init__(self, registry: KeyValue, *, ttl_s: float = TTL_S) -> None:
        self._registry = registry
        self._ttl_s = ttl_s
        self._seen: dict[str, tuple[bool, float]] = {}

    async def has(self, parent_agent: str, method: str, *, recheck_absent: bool = False) -> bool:
        """Whether a handler registered `method` for `parent_agent`, as of at most `ttl_s`
        ago. `recheck_absent` asks the bucket again when it was absent, so a request made
        right after its handler registered is not refused."""
        key = f"hook.{parent_agent}.{method}"
        seen = self._seen.get(key)
        if (seen is not None and time.monotonic() - seen[1] < self._ttl_s
                and (seen[0] or not recheck_absent)):
            return seen[0]
        try:
            await self._registry.get(key)
            found = True
        except KeyNotFoundError:
            found = False
        if len(self._seen) > 10_000:  # bounded by the registered keys; this is a safety net
            self._seen.clear()
        self._seen[key] = (found, time.monotonic())
        return found
