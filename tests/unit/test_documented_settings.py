"""Every `TETHER_...` variable the documentation and the changelog name exists: a setting
(`TETHER_<NAME>` of `Settings`), a stream or bucket of the default prefix, a NATS user's
credential (`tether.access`), or a variable the code, the scripts or the deployment files
read. A name the docs promise that nothing reads
is a setting a user sets in vain."""

import re
from pathlib import Path

from tether.access import USERS, nkey_variable, password_variable
from tether.cli import ALL_SERVICES_HEALTH_PORT, SERVICE_HEALTH_PORTS
from tether.config import Settings
from tether.contract.subjects import Subjects
from tether.ui.serving import DEFAULT_PORT

ROOT = Path(__file__).parents[2]
DOCUMENTED = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
READERS = [*(ROOT / "libs").rglob("*.py"), *(ROOT / "services").rglob("*.py"),
           *(ROOT / "scripts").glob("*"), *(ROOT / "deploy").rglob("*"), ROOT / "Makefile",
           ROOT / "docker-compose.yml"]
NAME = re.compile(r"TETHER_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_<])")


def test_every_documented_tether_variable_is_read_by_something() -> None:
    subjects = Subjects()
    known = {f"TETHER_{field.upper()}" for field in Settings.model_fields}
    known |= {subjects.stream(kind) for kind in
              ("CMD", "EVENTS", "PROGRESS", "WORK", "HOOKS", "CHAT", "REGISTRY", "SLOTS",
               "DELIVERIES")}
    known |= {make(user) for user in USERS for make in (password_variable, nkey_variable)}
    read = "\n".join(path.read_text(errors="replace") for path in READERS if path.is_file())
    unknown = {}
    for page in DOCUMENTED:
        for name in set(NAME.findall(page.read_text())):
            if name not in known and name not in read:
                unknown.setdefault(name, page.name)
    assert unknown == {}, "documented, and nothing reads them"


def test_every_setting_and_default_port_is_in_the_configuration_page() -> None:
    """docs/configuration.md lists every setting and every port a service listens on."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f"TETHER_{field.upper()}" for field in Settings.model_fields
               if f"`TETHER_{field.upper()}`" not in page]
    ports = {*SERVICE_HEALTH_PORTS.values(), ALL_SERVICES_HEALTH_PORT, DEFAULT_PORT}
    missing += [str(port) for port in sorted(ports) if not re.search(rf"\b{port}\b", page)]
    assert missing == []
