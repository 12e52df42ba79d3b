"""How often a requester outside Tether's own NATS account may ask the parent's costly
queries (`has_run`, `history`): a token bucket per requester, in memory per replica.

The requester is named by the server, not by the request: a request that crosses into
Tether's account through an import carries the `Nats-Request-Info` header with the
requesting account (and user, where the export shares it), which an application cannot
forge. A request without it comes from inside Tether's account (a service, the admin)
and is not limited. The buckets are a pure function of the times they are given.
"""

import json
from dataclasses import dataclass

REQUEST_INFO_HEADER = "Nats-Request-Info"
# Full buckets idle this long are forgotten, so one-off requesters cost nothing.
FORGET_AFTER_S = 300.0


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RequestRates:
    """`rate_per_s` requests a second per requester, `burst` at once."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be positive and burst at least 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, _Bucket] = {}
        self._swept_at = 0.0

    def take(self, requester: str, now_s: float) -> float:
        """Take one request for `requester` at `now_s`: 0 when it may go ahead, else the
        seconds until it may."""
        bucket = self._buckets.get(requester)
        if bucket is None:
            bucket = self._buckets[requester] = _Bucket(float(self.burst), now_s)
        else:
            elapsed = max(now_s - bucket.at, 0.0)
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
            bucket.at = now_s
        if now_s - self._swept_at > FORGET_AFTER_S:
            self._sweep(now_s)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / self.rate_per_s

    def remembered(self) -> int:
        """How many requesters have a bucket now."""
        return len(self._buckets)

    def _sweep(self, now_s: float) -> None:
        self._swept_at = now_s
        for requester, bucket in list(self._buckets.items()):
            if now_s - bucket.at > FORGET_AFTER_S:
                del self._buckets[requester]


def requester_of(headers: dict[str, str] | None) -> str | None:
    """The account (and user, when shared) a request came from through an import, as the
    server wrote it; None for a request from inside Tether's account."""
    info = (headers or {}).get(REQUEST_INFO_HEADER)
    if info is None:
        return None
    try:
        described = json.loads(info)
    except ValueError:
        return "unreadable"
    if not isinstance(described, dict):
        return "unreadable"
    account = str(described.get("acc", ""))
    user = described.get("user")
    return f"{account}/{user}" if user else account
