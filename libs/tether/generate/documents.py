"""What the generators of checked-in documents share: how a document is written, how the
files on disk are compared with what would be generated, and how drift is reported."""

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def render(document: Any) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def differences(directory: Path, documents: dict[str, Any], files: Iterable[Path], *,
                unknown: str) -> list[str]:
    """How `files` (the generator's, under `directory`) differ from `documents` (relative
    path -> document); `unknown` says what a file no document matches is."""
    expected = {path: render(document) for path, document in documents.items()}
    found = {str(p.relative_to(directory)): p.read_text() for p in files}
    problems = [f"missing: {p}" for p in sorted(expected.keys() - found.keys())]
    problems += [f"{unknown}: {p}" for p in sorted(found.keys() - expected.keys())]
    problems += [f"differs: {p}" for p in sorted(expected.keys() & found.keys())
                 if expected[p] != found[p]]
    return problems


def write(directory: Path, documents: dict[str, Any], files: Iterable[Path]) -> None:
    """Write `documents` under `directory`, and remove those of `files` (the generator's
    files before) that no document is any more."""
    stale = [p for p in files if str(p.relative_to(directory)) not in documents]
    for name, document in documents.items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(document))
    for path in stale:
        path.unlink()


def report(problems: list[str]) -> int:
    """Each problem on stderr, with how to mend them; the exit code of `--check`."""
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("run `make schemas` to regenerate", file=sys.stderr)
    return 1 if problems else 0
