"""Processes whose wall clock is off: Debian's libfaketime, preloaded, with the
monotonic clock left real (`FAKETIME_DONT_FAKE_MONOTONIC=1`), as a skewed host's would be.

The suite's CI installs the `faketime` package (`.ci/run`); a run without it fails with
that instruction rather than skipping the checks that need it."""

import glob
import os

LIBRARY_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1")


def libfaketime() -> str:
    for pattern in LIBRARY_GLOBS:
        if found := sorted(glob.glob(pattern)):
            return found[0]
    raise RuntimeError("libfaketime is not installed: `apt-get install faketime` (Debian's "
                       "package; .ci/run installs it)")


def faketime_env(offset: str) -> dict[str, str]:
    """The variables that put a process's wall clock `offset` off: `+30s`, `-30s`."""
    return {"LD_PRELOAD": libfaketime(), "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}


def skewed_env(offset: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (this process's by default) with the wall clock `offset` off."""
    return {**(os.environ if env is None else env), **faketime_env(offset)}
