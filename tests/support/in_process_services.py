"""Test support for the services run in the test's own process (`<service>.serve`)."""

from collections.abc import Iterable
from contextlib import suppress


async def all_ready(checks: Iterable[dict]) -> bool:
    """Every service registered its readiness checks (one dict per service, filled by its
    `serve`), and each one passes."""
    checks = list(checks)
    if not checks or not all(checks):
        return False
    for service_checks in checks:
        for check in service_checks.values():
            with suppress(Exception):
                if (await check())[0]:
                    continue
            return False
    return True
