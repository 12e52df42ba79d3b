"""`make test` installs the system programs its tests need (scripts/test-deps.sh), or says
which and how: a fresh machine runs the README's test command as CI does."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "test-deps.sh"
PROGRAMS = ("chromium", "chromedriver", "redis-server", "faketime", "npm")


def stub(bin_dir: Path, name: str, body: str = "exit 0") -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def run(tmp_path: Path, *, present: tuple[str, ...], uid: int = 0, apt: bool = True,
        sudo: bool = False) -> subprocess.CompletedProcess:
    """The script on a PATH of stubs only: the programs `present`, `id -u` answering `uid`,
    an apt-get (and a password-less sudo) that log how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name in present:
        stub(bin_dir, name)
    stub(bin_dir, "id", f"echo {uid}")
    if apt:
        stub(bin_dir, "apt-get", f'echo "apt-get $* DEBIAN_FRONTEND=$DEBIAN_FRONTEND" >> {calls}')
    if sudo:
        stub(bin_dir, "sudo", f'[ "$1" = -n ] && shift; [ "$1" = true ] && exit 0; '
                              f'echo "sudo" >> {calls}; "$@"')
    result = subprocess.run(["/bin/bash", str(SCRIPT)], env={"PATH": str(bin_dir)},
                            capture_output=True, text=True, timeout=30, check=False)
    result.calls = calls.read_text().splitlines() if calls.exists() else []  # type: ignore[attr-defined]
    return result


def test_nothing_is_installed_when_every_program_is_there(tmp_path):
    result = run(tmp_path, present=PROGRAMS)
    assert (result.returncode, result.calls, result.stderr) == (0, [], "")


def test_the_missing_programs_are_installed_as_root(tmp_path):
    result = run(tmp_path, present=("chromium", "chromedriver"))
    assert result.returncode == 0, result.stderr
    assert result.calls == [
        "apt-get update -q DEBIAN_FRONTEND=",
        ("apt-get install -y -q --no-install-recommends redis-server faketime npm "
         "DEBIAN_FRONTEND=noninteractive")]


def test_a_user_with_password_less_sudo_installs_through_it(tmp_path):
    result = run(tmp_path, present=("redis-server", "faketime", "npm"), uid=1000, sudo=True)
    assert result.returncode == 0, result.stderr
    assert result.calls == [
        "sudo", "apt-get update -q DEBIAN_FRONTEND=",
        "sudo", ("apt-get install -y -q --no-install-recommends chromium chromium-driver "
                 "DEBIAN_FRONTEND=noninteractive")]


@pytest.mark.parametrize(("apt", "says"), [
    (True, ("sudo apt-get install -y -q --no-install-recommends chromium chromium-driver "
            "redis-server faketime npm")),
    (False, "has no apt-get"),
], ids=["no-root", "no-apt"])
def test_otherwise_it_names_what_is_missing_and_how_and_fails(tmp_path, apt, says):
    result = run(tmp_path, present=(), uid=1000, apt=apt)
    assert result.returncode == 2
    assert result.calls == []
    assert "chromium chromium-driver redis-server faketime npm" in result.stderr
    assert says in result.stderr


def test_make_test_and_the_chaos_scenarios_run_it_first():
    made = subprocess.run(["make", "-n", "test", "test-chaos"], capture_output=True, text=True,
                          cwd=SCRIPT.parents[1], env={**os.environ, "MAKEFLAGS": ""},
                          timeout=30, check=True)
    lines = made.stdout.splitlines()
    assert lines.count("scripts/test-deps.sh") == 1, made.stdout
    assert lines.index("scripts/test-deps.sh") < next(
        i for i, line in enumerate(lines) if "pytest" in line)
