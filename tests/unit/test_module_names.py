"""One name per concept: no two modules of `libs/tether` share a file name, except the
names that mean the same thing in each package that has one."""

from collections import defaultdict
from pathlib import Path

import tether

# A service package's core (`parent/service.py`, `reconciler/service.py`) and what a
# package raises (`client/errors.py`, `agents/errors.py`).
SHARED_ON_PURPOSE = {"__init__.py", "service.py", "errors.py"}


def test_no_two_modules_share_a_name_unless_it_means_the_same_in_each_package() -> None:
    root = Path(tether.__file__).parent
    by_name: dict[str, list[str]] = defaultdict(list)
    for module in root.rglob("*.py"):
        by_name[module.name].append(str(module.relative_to(root)))
    shared = {name: sorted(paths) for name, paths in by_name.items()
              if len(paths) > 1 and name not in SHARED_ON_PURPOSE}
    assert shared == {}
