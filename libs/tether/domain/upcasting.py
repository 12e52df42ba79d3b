"""Bring old event shapes forward.

An event in the log is never rewritten. When a shape changes, its `schema_version` is
bumped and an upcaster `vN -> vN+1` is registered here; decoding applies them in order
until the payload has the current shape. Each old version has a golden JSON file under
`tests/golden/events/` that must keep loading.
"""

from collections.abc import Callable
from typing import Any

from tether.domain.events import CURRENT_VERSIONS

Payload = dict[str, Any]
Upcaster = Callable[[Payload], Payload]

_UPCASTERS: dict[tuple[str, int], Upcaster] = {}

# The defaults in force when version-1 events were written.
_V1_DETACHED_MAX_BUDGET_MS = 24 * 60 * 60 * 1000
_V1_DETACHED_NO_PROGRESS_BUDGET_MS = 60 * 60 * 1000


class EventShapeError(ValueError):
    """An event payload that cannot be brought to a current shape."""


class UnknownEventType(EventShapeError):
    pass


class UnknownSchemaVersion(EventShapeError):
    pass


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(function: Upcaster) -> Upcaster:
        key = (event_type, from_version)
        if key in _UPCASTERS:
            raise RuntimeError(f"two upcasters for {event_type} v{from_version}")
        _UPCASTERS[key] = function
        return function

    return register


def upcast(payload: Payload) -> Payload:
    """Return `payload` in the current shape of its type (a new dict; the input is kept)."""
    event_type = payload.get("type")
    if event_type not in CURRENT_VERSIONS:
        raise UnknownEventType(f"unknown event type {event_type!r}")
    current = CURRENT_VERSIONS[event_type]
    version = payload.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UnknownSchemaVersion(f"{event_type}: schema_version {version!r} is not a version")
    if version > current:
        raise UnknownSchemaVersion(
            f"{event_type}: schema_version {version} is newer than this build knows ({current})"
        )
    while version < current:
        step = _UPCASTERS.get((event_type, version))
        if step is None:
            raise UnknownSchemaVersion(f"{event_type}: no upcaster from version {version}")
        payload = {**step(dict(payload)), "schema_version": version + 1}
        version += 1
    return payload


@upcaster("run.requested", from_version=1)
def upcast_run_requested_v1_v2(payload: Payload) -> Payload:
    """v1 had `detached: bool` and a top-level `on_finish`; v2 has options and budgets."""
    data = dict(payload["data"])
    detached = bool(data.pop("detached", False))
    on_finish = data.pop("on_finish", None)
    if detached:
        data["detached"] = {"on_finish": on_finish}
        data["max_budget_ms"] = _V1_DETACHED_MAX_BUDGET_MS
        data["no_progress_budget_ms"] = _V1_DETACHED_NO_PROGRESS_BUDGET_MS
    else:
        data["detached"] = None
        data["max_budget_ms"] = None
        data["no_progress_budget_ms"] = 0
    return {**payload, "data": data}


@upcaster("run.requested", from_version=2)
def upcast_run_requested_v2_v3(payload: Payload) -> Payload:
    """v2 did not name the run as a parent: its nested runs are owned by its run id alone
    (`<agent type>/<run id>`), so that is its name."""
    return {**payload, "data": {**payload["data"], "nested_parent": payload["run_id"]}}


@upcaster("run.requested", from_version=3)
def upcast_run_requested_v3_v4(payload: Payload) -> Payload:
    """v3 had no token or cost budget, and no budgets above it."""
    return {**payload, "data": {"max_tokens": None, "max_cost": None, "budgets_above": [],
                                **payload["data"]}}


@upcaster("run.requested", from_version=4)
def upcast_run_requested_v4_v5(payload: Payload) -> Payload:
    """Version 5 adds `fork` (a fork's origin): an earlier request is no fork."""
    return payload


@upcaster("run.interrupted", from_version=1)
def upcast_run_interrupted_v1_v2(payload: Payload) -> Payload:
    """v1 did not say whether the child was still running; it was never kept alive then."""
    return {**payload, "data": {"child_still_running": False, **payload["data"]}}


@upcaster("run.running", from_version=1)
def upcast_run_running_v1_v2(payload: Payload) -> Payload:
    """v1 did not record the version of the agent code the runner ran."""
    return {**payload, "data": {"agent_version": None, **payload["data"]}}


@upcaster("run.budget_reserved", from_version=1)
def upcast_run_budget_reserved_v1_v2(payload: Payload) -> Payload:
    """Version 2 adds `owner` (the request claiming the share): a version-1 share is
    claimed by no request, so no request withdraws it."""
    return payload


@upcaster("run.budget_released", from_version=1)
def upcast_run_budget_released_v1_v2(payload: Payload) -> Payload:
    """Version 2 adds `owner` (a request withdrawing its claim): a version-1 release is
    the run's end, which frees the share."""
    return payload


def registered_upcasters() -> dict[tuple[str, int], Upcaster]:
    return dict(_UPCASTERS)
