"""The programs of a documentation page, run as written against the test stack, with the
services they need started beside them (tests/e2e/test_docs.py; with Tether installed
from its wheel, tests/e2e/test_wheel_install.py).

Conventions the pages follow (kept few and visible in the text):
- a block whose first line is `# save as NAME.py` is written to the page's working
  directory as that file; `# save as NAME.py, then: python NAME.py` is written and run;
- every other block is run as a program in that directory, in page order;
- a ```text block after a line "It prints:" is the exact output of the program before it;
- `<!-- not run: why -->` on the line before a block leaves it out (fragments only);
- the page's services are `tether services all`, started in that directory with every
  `ChildAgent` / `ModelAgent` class of the saved files as `--agents module:Class`, which
  also proves the `tether` script finds modules in the current directory.
"""

import asyncio
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from service_processes import ServiceProcess

from tether.adapters.nats_connection import connect_nats
from tether.adapters.streams import remove_streams
from tether.config import Settings

SAVE = re.compile(r"^# save as (?P<name>[\w.]+\.py)(?:, then: python (?P<run>[\w.]+\.py))?\s*$")
AGENT_CLASS = re.compile(r"^class (\w+)\((?:ChildAgent|ModelAgent|ModelParent)\):", re.MULTILINE)
BLOCK_BUDGET_S = 60
SERVICES_READY_S = 30


@dataclass
class Block:
    line: int
    code: str
    skipped: bool
    expected_output: str | None = None


@dataclass(frozen=True)
class PythonEnvironment:
    """The `python` and `tether` a page runs with: this test run's, or another
    environment's (a virtual environment Tether was installed into)."""

    python: Path
    tether: Path

    @classmethod
    def in_bin(cls, bin_dir: Path) -> "PythonEnvironment":
        return cls(bin_dir / "python", bin_dir / "tether")


THIS_ENVIRONMENT = PythonEnvironment(Path(sys.executable), Path(sys.executable).parent / "tether")


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = lines[index].strip()
        if fence.startswith("```"):
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            body = "\n".join(lines[index + 1:end]) + "\n"
            before = next((lines[i].strip() for i in range(index - 1, -1, -1)
                           if lines[i].strip()), "")
            if fence == "```python":
                blocks.append(Block(index + 1, body, before.startswith("<!-- not run:")))
            elif fence == "```text" and before == "It prints:" and blocks:
                blocks[-1].expected_output = body
            index = end
        index += 1
    return blocks


async def run_page(page: Path, nats_url: str, database_url: str, directory: Path,
                   environment: PythonEnvironment = THIS_ENVIRONMENT) -> list[dict]:
    """Run the page's programs in `directory` with `environment`'s python, against its
    `tether services all`; the services' log lines."""
    blocks = [block for block in python_blocks(page) if not block.skipped]
    programs: list[tuple[Block, str]] = []
    agents: list[str] = []
    for number, block in enumerate(blocks):
        saved = SAVE.match(block.code.splitlines()[0])
        name = saved["name"] if saved else f"block_{number}.py"
        (directory / name).write_text(block.code)
        if saved:
            agents += [f"{name[:-3]}:{cls}" for cls in AGENT_CLASS.findall(block.code)]
        if not saved or saved["run"]:
            programs.append((block, name))
    prefix = "t" + uuid.uuid4().hex[:10]
    settings = Settings(nats_url=nats_url, database_url=database_url, prefix=prefix,
                        projection_schema=prefix)
    # The programs import what their environment installed, not what this run has on
    # its path.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TETHER_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(TETHER_NATS_URL=nats_url, TETHER_DATABASE_URL=database_url,
               TETHER_PREFIX=prefix, TETHER_PROJECTION_SCHEMA=prefix)
    # Free ports: another stack (a developer's `tether services all`) may hold 8090.
    service = ScriptService(directory, agents, {**env, "TETHER_HEALTH_PORT": "0",
                                                "TETHER_UI_PORT": "0",
                                                "TETHER_LOG_FORMAT": "json"},
                            environment.tether)
    try:
        await service.start()
        await service.logged("parent.ready", timeout=SERVICES_READY_S)
        # The README's quickstart runs as written twice, with the same output.
        times = ("", " run again") if page.name == "README.md" else ("",)
        for block, name in programs:
            for again in times:
                process = await asyncio.create_subprocess_exec(
                    str(environment.python), name, cwd=directory, env=env,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE)
                out, err = await asyncio.wait_for(process.communicate(),
                                                  timeout=BLOCK_BUDGET_S)
                where = f"{page.name}, the block at line {block.line}{again}"
                assert process.returncode == 0, f"{where} failed:\n{err.decode()}"
                assert err.decode() == "", f"{where} wrote to stderr:\n{err.decode()}"
                if block.expected_output is not None:
                    assert out.decode() == block.expected_output, where
    finally:
        await service.stop()
        nc = await connect_nats(nats_url, name="tether-docs-test")
        await remove_streams(nc.jetstream(), settings.subjects)
        await nc.drain()
        conn = await asyncpg.connect(database_url)
        await conn.execute(f'DROP SCHEMA IF EXISTS "{prefix}" CASCADE')
        await conn.close()
    return service.lines


class ScriptService(ServiceProcess):
    """`tether services all` through a `tether` script, in `cwd`."""

    def __init__(self, cwd: Path, agents: list[str], env: dict[str, str],
                 script: Path) -> None:
        super().__init__("all", env)
        self.cwd, self.agents, self.script = cwd, agents, script

    async def start(self) -> "ScriptService":
        args = ["--agents", ",".join(self.agents)] if self.agents else []
        await self._spawn(str(self.script), "services", "all", *args, cwd=self.cwd,
                          stdin=asyncio.subprocess.DEVNULL)
        await asyncio.wait_for(self._started.wait(), timeout=SERVICES_READY_S)
        return self
