"""The layers of libs/tether hold: read off the source, every import counted (at module
level, under TYPE_CHECKING and inside functions alike)."""

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

import tether
from tether import ports
from tether.adapters import event_log, jetstream, nats_connection, streams

ROOT = Path(tether.__file__).parent


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module
    imported: str  # the module it imports
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = ["tether", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, modules: set[str]) -> list[Import]:
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend(Import(importer, alias.name, child.lineno, in_function)
                             for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    # `from tether.adapters import denials` imports the module itself.
                    target = f"{base}.{alias.name}"
                    found.append(Import(importer, target if target in modules else base,
                                        child.lineno, in_function))
            visit(child, nested)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return [found for path in paths for found in _imports_of(path, modules)]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(imports: list[Import], importer: str, forbidden: str) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.imported}" for i in imports
            if _within(i.importer, importer) and _within(i.imported, forbidden)]


LAYERS = tomllib.loads((ROOT / "layers.toml").read_text())["layer"]


def package_of(module: str) -> str:
    """`tether.parent.service` -> `parent`; `tether` itself -> `tether`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tether"


def layer_of() -> dict[str, int]:
    return {package: index for index, layer in enumerate(LAYERS) for package in layer["packages"]}


def _paths(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` reaches, with one import chain that reaches it."""
    chains, queue = {start: [start]}, [start]
    while queue:
        module = queue.pop(0)
        for successor in sorted(graph.get(module, ())):
            if successor not in chains:
                chains[successor] = [*chains[module], successor]
                queue.append(successor)
    return chains


def _layer_violations(imports: list[Import], layers: dict[str, int]) -> list[str]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        if _within(i.imported, "tether"):
            graph.setdefault(i.importer, set()).add(i.imported)
    wrong = []
    for module in sorted(graph):
        here = package_of(module)
        for reached, chain in _paths(graph, module).items():
            there = package_of(reached)
            if there != here and layers[there] >= layers[here]:
                wrong.append(" -> ".join(chain))
    return wrong


def test_every_package_has_one_place_in_the_map():
    named = [package for layer in LAYERS for package in layer["packages"]]
    present = {path.stem if path.is_file() else path.name for path in ROOT.iterdir()
               if (path.suffix == ".py" and path.stem != "__init__")
               or (path.is_dir() and (path / "__init__.py").exists())}
    assert sorted(set(named)) == sorted(named), "a package is named twice"
    assert sorted(present | {"tether"}) == sorted(named)


def test_no_module_reaches_a_package_of_its_own_layer_or_above_even_through_a_third(imports):
    assert _layer_violations(imports, layer_of()) == []


def test_the_layer_check_follows_imports_through_a_third():
    imports = [Import("tether.parent.service", "tether.agent_registry", 1, False),
               Import("tether.agent_registry", "tether.child.agent", 1, False)]
    layers = {"parent": 2, "child": 2, "agent_registry": 1}
    assert _layer_violations(imports, layers) == [
        "tether.agent_registry -> tether.child.agent",
        "tether.parent.service -> tether.agent_registry -> tether.child.agent"]


def test_only_the_cli_imports_inside_a_function(imports):
    allowed = {package for layer in LAYERS for package in layer.get("imports_in_functions", ())}
    assert [f"{i.importer}:{i.line} imports {i.imported}" for i in imports
            if i.in_function and _within(i.imported, "tether")
            and package_of(i.importer) not in allowed] == []


def test_the_domain_imports_only_itself_its_model_libraries_and_the_standard_library(imports):
    allowed = ("tether.domain", "pydantic", "pydantic_core", "msgspec")
    wrong = [f"{i.importer}:{i.line} imports {i.imported}" for i in imports
             if _within(i.importer, "tether.domain")
             and not (any(_within(i.imported, p) for p in allowed)
                      or (i.imported.split(".")[0] in sys.stdlib_module_names
                          and i.imported.split(".")[0] != "asyncio"))]
    assert wrong == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, as the modules along it; None when it has none."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return [*path[path.index(successor):], successor]
            if successor not in state and (found := visit(successor)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_client_has_no_import_cycle_not_even_for_type_checking(imports):
    graph: dict[str, set[str]] = {}
    for i in imports:
        if _within(i.importer, "tether.client") and _within(i.imported, "tether.client") \
                and i.importer != "tether.client" and i.imported != "tether.client":
            graph.setdefault(i.importer, set()).add(i.imported)
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_tethers_own_code_does_not_import_the_jetstream_re_exports(imports):
    assert _violations(imports, "tether", "tether.adapters.jetstream") == []


def test_the_jetstream_module_re_exports_what_applications_import_from_it():
    assert jetstream.EventLog is event_log.EventLog
    assert jetstream.connect_nats is nats_connection.connect_nats
    assert jetstream.ensure_streams is streams.ensure_streams
    assert jetstream.StoredEvent is ports.StoredEvent
    assert set(jetstream.__all__) <= set(dir(jetstream))
