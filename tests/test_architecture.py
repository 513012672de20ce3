"""The package's shape: no import cycles, strategies that do not reach into the server, a coordinator that
never imports a server-side strategy class, and a wheel that lists every package.

Reads the source with ``ast`` (nothing is imported), so a violation fails here before it fails anywhere else.
Every import counts: module level, ``if TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ecrec", "baselines")


def _module_files() -> dict[str, Path]:
    files = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts)
            if name.startswith("ecrec.wire."):
                continue  # generated gRPC code
            files[name] = path
    return files


MODULES = _module_files()


def _imports(name: str) -> set[str]:
    """Project modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_is_not_empty():
    assert len(MODULES) > 30 and "ecrec.server" in GRAPH["ecrec.cli"]


def test_no_import_cycles():
    # a package importing its own submodules (``ecrec/strategies/__init__`` re-exporting) is not a cycle
    # unless a submodule imports the package back
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_command_line_imports_the_server():
    importers = sorted(name for name, deps in GRAPH.items() if "ecrec.server" in deps)
    assert importers == ["ecrec.cli"], importers


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("ecrec.strategies", "baselines"))))
def test_strategies_use_only_the_host_interface(name):
    assert "ecrec.server" not in _closure(name), f"{name} reaches ecrec.server"


def _server_class_modules() -> set[str]:
    from ecrec.strategies import available, get_spec

    return {get_spec(n).server_class.partition(":")[0] for n in available()}


def test_specs_name_server_classes_that_exist():
    modules = _server_class_modules()
    assert {"ecrec.strategies.erasure.strategy", "baselines.cpr"} <= modules
    assert modules <= set(MODULES)


@pytest.mark.parametrize("light", ["ecrec.coordinator", "ecrec.strategies.builtin", "baselines.options",
                                   "baselines.driver", "ecrec.bench.compare", "ecrec.bench.simulate",
                                   "ecrec.client"])
def test_light_modules_never_import_server_side_strategies(light):
    reached = _closure(light) & _server_class_modules()
    assert not reached, f"{light} imports server-side strategy modules {sorted(reached)}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_the_wheel_lists_every_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.relative_to(ROOT).parts[:-1]) for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert config["package-dir"]["ecrec.cuda_kernels"] == "cuda_kernels"
    assert list((ROOT / "cuda_kernels").glob("*.cu"))
