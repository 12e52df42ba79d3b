"""`import tether` stays cheap, and every public name it lists resolves."""

import subprocess
import sys

import tether


def test_importing_tether_loads_no_client_library() -> None:
    code = ("import sys, tether; "
            "print(sorted(m for m in ('nats', 'pydantic', 'asyncpg', 'structlog') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_resolves() -> None:
    for name in tether.__all__:
        assert getattr(tether, name) is not None, name
    assert tether.AgentToolFailure.__name__ == "AgentToolFailure"
    assert callable(tether.connect)
    assert set(tether.__all__) <= set(dir(tether))
