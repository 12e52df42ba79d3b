"""docs/ui.md's screenshot command runs as written (into a file of the test's own, not the
picture in docs/images): the script's scene still builds, its nested runs appear on the
timeline, and Chromium writes the picture."""

import asyncio
import os
import re
import shlex
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"regenerates the picture above:\n\n```sh\n(?P<command>[^\n]+)\n```")
WITHIN_S = 90


def documented_command() -> list[str]:
    found = COMMAND.search((ROOT / "docs" / "ui.md").read_text())
    assert found, "docs/ui.md: no ```sh block after 'regenerates the picture above:'"
    return shlex.split(found["command"])


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


async def test_the_documented_screenshot_command_writes_the_picture(nats_url, database_url,
                                                                    tmp_path):
    picture = tmp_path / "ui-timeline.png"
    # The stack's URLs are set, so `devstack.py test` runs the command on the test's servers.
    env = {**os.environ, "TETHER_NATS_URL": nats_url, "TETHER_DATABASE_URL": database_url}
    process = await asyncio.create_subprocess_exec(
        *documented_command(), str(picture), cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(WITHIN_S):
            output, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, output.decode(errors="replace")
    assert f"wrote {picture}" in output.decode()
    width, height = png_size(picture)
    assert width == 1200 and height > 1000, (width, height)  # the whole timeline, full page
