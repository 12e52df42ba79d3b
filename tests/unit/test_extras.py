"""Optional parts: a missing extra is named with the command that installs it, by the
modules that need it and by the commands that run them. A missing package is simulated
as Python does for a name set to None in sys.modules: its import fails."""

import argparse
import importlib
import subprocess
import sys

import pytest

from tether.agent_registry import AgentConfigurationError
from tether.agents import AgentDefinition, ModelAgent
from tether.agents.model_agent import MODEL_CLIENT_VARIABLE, client_for
from tether.cli import SERVICE_MODULES, _service_names, services_to_run
from tether.config import Settings
from tether.extras import MissingExtra, installed, require

WITHOUT_UI = ("the web timeline (`tether ui`, the `ui` service) needs the 'ui' extra: "
              "pip install 'tether[ui]'")
WITHOUT_OPENAI = ("the OpenAI-compatible model client needs the 'openai' extra: "
                  "pip install 'tether[openai]'")
OPENAI_CLIENT = "tether.agents.clients.openai_compatible"


def uninstall(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """The packages and their submodules cannot be imported, until the test ends."""
    for package in packages:
        for name in [name for name in sys.modules if name.startswith(f"{package}.")]:
            monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.setitem(sys.modules, package, None)


def forget(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """The modules are imported afresh by the test (and put back after it)."""
    for module in modules:
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_an_installed_extra_is_taken_as_it_is() -> None:
    assert installed("ui") and installed("openai") and installed("otel")
    assert installed("gateway")
    require("ui")
    with_callers = Settings(gateway_callers_file="callers.toml")
    assert services_to_run("all", with_callers) == sorted(SERVICE_MODULES)
    assert services_to_run("ui") == ["ui"]
    assert services_to_run("gateway") == ["gateway"]


def test_all_runs_the_gateway_only_where_its_callers_are_set() -> None:
    assert "gateway" not in services_to_run("all", Settings())
    assert "gateway" not in services_to_run("all")


@pytest.mark.parametrize(("extra", "package"), [("ui", "uvicorn"), ("ui", "starlette"),
                                                ("gateway", "mcp"), ("gateway", "a2a"),
                                                ("openai", "httpx"), ("otel", "opentelemetry")])
def test_a_missing_extra_is_named_with_how_to_install_it(monkeypatch, extra, package) -> None:
    uninstall(monkeypatch, package)
    assert not installed(extra)
    with pytest.raises(MissingExtra) as missing:
        require(extra)
    assert str(missing.value).endswith(f"needs the '{extra}' extra: "
                                       f"pip install 'tether[{extra}]'")


@pytest.mark.parametrize(("module", "package"), [("tether.ui.serving", "uvicorn"),
                                                 ("tether.ui.app", "starlette")])
def test_the_ui_modules_name_their_extra(monkeypatch, module, package) -> None:
    forget(monkeypatch, "tether.ui.serving", "tether.ui.app", "tether.asgi_serving")
    uninstall(monkeypatch, package)
    with pytest.raises(MissingExtra) as missing:
        importlib.import_module(module)
    assert str(missing.value) == WITHOUT_UI


def test_the_gateway_names_its_extra(monkeypatch) -> None:
    forget(monkeypatch, "tether.gateway.server", "tether.gateway.mcp_tools")
    uninstall(monkeypatch, "mcp")
    with pytest.raises(MissingExtra) as missing:
        importlib.import_module("tether.gateway.server")
    assert str(missing.value).endswith("pip install 'tether[gateway]'")
    with pytest.raises(MissingExtra):
        services_to_run("gateway")


def test_the_services_run_without_the_ui_and_the_ui_service_alone_is_refused(monkeypatch):
    uninstall(monkeypatch, "uvicorn")
    assert services_to_run("all") == ["child-runner", "parent", "projector", "reconciler"]
    assert services_to_run("parent") == ["parent"]
    with pytest.raises(MissingExtra) as missing:
        services_to_run("ui")
    assert str(missing.value) == WITHOUT_UI


def test_the_openai_compatible_client_names_its_extra(monkeypatch) -> None:
    forget(monkeypatch, OPENAI_CLIENT)
    uninstall(monkeypatch, "httpx")
    with pytest.raises(MissingExtra) as missing:
        importlib.import_module(OPENAI_CLIENT)
    assert str(missing.value) == WITHOUT_OPENAI


def test_a_model_client_setting_that_needs_the_openai_extra_says_so(monkeypatch) -> None:
    class Asker(ModelAgent):
        definition = AgentDefinition(id="asker", model="any-model", description="Asks")

    forget(monkeypatch, OPENAI_CLIENT)
    uninstall(monkeypatch, "httpx")
    monkeypatch.setenv(MODEL_CLIENT_VARIABLE, f"{OPENAI_CLIENT}:from_env")
    with pytest.raises(AgentConfigurationError) as misconfigured:
        client_for(Asker)
    assert str(misconfigured.value) == \
        f"{MODEL_CLIENT_VARIABLE}='{OPENAI_CLIENT}:from_env': {WITHOUT_OPENAI}"


# `tether` itself, in a process of its own: the command configures the process's logging.
WITHOUT = "import sys; sys.modules[{package!r}] = None; from tether.cli import main; " \
          "sys.exit(main({argv!r}))"


@pytest.mark.parametrize("argv", [["ui"], ["services", "ui"]], ids=" ".join)
def test_a_command_that_needs_the_ui_extra_exits_2_naming_it(argv) -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT.format(package="uvicorn", argv=argv)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"tether: {WITHOUT_UI}\n")


@pytest.mark.parametrize("text", ["projector,reconciler", "parent,child-runner,projector"])
def test_services_in_one_process_are_named_with_commas(text):
    assert _service_names(text) == text
    assert services_to_run(text) == text.split(",")


@pytest.mark.parametrize(("text", "said"), [
    ("projector,nope", "not a service: 'nope'"),
    ("projector,projector", "several of them once each"),
    ("all,parent", "not a service: 'all'"),
])
def test_a_wrong_list_of_services_says_what_is_wrong(text, said):
    with pytest.raises(argparse.ArgumentTypeError, match=said):
        _service_names(text)


def test_a_process_running_some_services_imports_only_theirs() -> None:
    # A fresh interpreter: this one has imported every service's module already.
    program = ("import sys; from tether.cli import SERVICE_MODULES, _services; "
               "served = _services(['projector', 'reconciler']); "
               "print(sorted(served), sorted(name for name, module in SERVICE_MODULES.items() "
               "if module in sys.modules))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.split("\n")[0] == "['projector', 'reconciler'] ['projector', 'reconciler']"
