"""The documentation runs as written: every ```python block of README.md and docs/*.md
is executed against the test stack, with the services it needs started by the test (the
conventions the pages follow: tests/support/page_programs.py)."""

import re
from pathlib import Path

import pytest
from page_programs import python_blocks, run_page

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def pages_with_python() -> list[Path]:
    """The pages with a block to run (a page whose blocks are all fragments has none)."""
    return [page for page in PAGES if any(not block.skipped for block in python_blocks(page))]


def test_the_readme_is_short_and_every_page_speaks_to_users() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 12 * 1024
    docs = [readme, *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md",
            ROOT / "bench" / "README.md", ROOT / "bench" / "HISTORY.md"]
    for page in docs:
        text = page.read_text()
        for word in ("DESIGN.md", "issue 7", "the seed", "seed's", "useAgentToolEvents"):
            assert word not in text, f"{page.name}: {word!r}"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            linked = (page.parent / target).resolve()
            assert linked.is_relative_to(ROOT) and linked.exists(), f"{page.name}: {target}"
    skipped = sum(block.skipped for page in PAGES for block in python_blocks(page))
    ran = sum(not block.skipped for page in PAGES for block in python_blocks(page))
    assert ran >= 2 and skipped <= 3, (ran, skipped)


@pytest.mark.parametrize("page", pages_with_python(), ids=lambda page: page.name)
async def test_the_python_of_the_page_runs_as_written(page: Path, nats_url, database_url,
                                                       tmp_path) -> None:
    await run_page(page, nats_url, database_url, tmp_path)
