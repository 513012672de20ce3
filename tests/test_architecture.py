"""The package's shape: packages by role in layers (a module imports only from its own layer or below), no
import cycles, strategies that do not reach into the server, a coordinator that never imports a server-side
strategy class, server processes that never import torch, and a wheel that lists every package.

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
            # ``from pkg import mod`` is an import of the module; ``from pkg import name`` of the package
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                       for alias in node.names]
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


#: the layers, bottom first: a module imports only from its own layer or a lower one (a package's modules share
#: its layer; the first prefix that matches places a module)
LAYERS = (
    ("ecrec.wire", "ecrec.errors", "ecrec.faults", "ecrec.protogen"),
    ("ecrec.coding", "ecrec.tables"),
    ("ecrec.net",),
    ("ecrec.config",),
    ("ecrec.strategies",),
    ("ecrec.control",),
    ("ecrec.snapshot",),
    ("ecrec.server",),
    ("ecrec.client",),
    ("ecrec.ops",),
    ("ecrec.cli", "ecrec.workload", "baselines"),
    ("ecrec.bench",),
)


def _layer(name: str) -> int:
    """The layer of the longest prefix in LAYERS that places ``name``."""
    if name == "ecrec":
        return 0  # the package's own __init__: no imports of the project
    found = [(len(p), level) for level, prefixes in enumerate(LAYERS) for p in prefixes
             if name == p or name.startswith(p + ".")]
    if not found:
        raise AssertionError(f"{name} is in no layer of LAYERS: place it")
    return max(found)[1]


def test_the_graph_is_not_empty():
    assert len(MODULES) > 30 and "ecrec.server.process" in GRAPH["ecrec.cli"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_reaches_up_a_layer(name):
    up = sorted(dep for dep in GRAPH[name] if _layer(dep) > _layer(name))
    assert not up, f"{name} (layer {_layer(name)}) imports from higher layers: " + ", ".join(
        f"{dep} (layer {_layer(dep)})" for dep in up)


def test_the_top_of_the_package_is_a_handful_of_entry_modules():
    top = sorted(p.stem for p in (ROOT / "ecrec").glob("*.py") if p.stem != "__init__")
    assert top == ["cli", "config", "errors", "faults", "protogen"], top


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


def _server_modules(names) -> set[str]:
    return {n for n in names if n == "ecrec.server" or n.startswith("ecrec.server.")}


def test_only_the_command_line_imports_the_server():
    importers = sorted(name for name, deps in GRAPH.items()
                       if _server_modules(deps) and not _server_modules({name}))
    # the warm parent of local clusters' processes loads it too (ecrec.ops.forks), to fork servers from
    assert importers == ["ecrec.cli", "ecrec.ops.forks"], importers


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(("ecrec.strategies", "baselines"))))
def test_strategies_use_only_the_host_interface(name):
    assert not _server_modules(_closure(name)), f"{name} reaches {sorted(_server_modules(_closure(name)))}"


def _server_class_modules() -> set[str]:
    from ecrec.strategies import available, get_spec

    return {get_spec(n).server_class.partition(":")[0] for n in available()}


def test_specs_name_server_classes_that_exist():
    modules = _server_class_modules()
    assert {"ecrec.strategies.erasure.strategy", "baselines.cpr"} <= modules
    assert modules <= set(MODULES)


@pytest.mark.parametrize("light", ["ecrec.control.coordinator", "ecrec.strategies.builtin", "baselines.options",
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


def test_server_and_coordinator_processes_never_import_torch(tmp_path):
    """torch costs a server process most of its start-up (0.8 s of 0.9 s measured) and is used by no server-side
    code: the server and coordinator modules, every strategy's server class and the snapshot items a server
    writes and reads stay clear of it (a subprocess, so that this test's own imports do not count)."""
    import subprocess

    code = f"""
import importlib, io, sys
import numpy as np
import ecrec.cli, ecrec.server.process, ecrec.control.coordinator, ecrec.ops.metrics, ecrec.ops.status
from ecrec.strategies import available, get_spec
from ecrec.snapshot import files
for name in available():
    importlib.import_module(get_spec(name).server_class.partition(":")[0])
with open({str(tmp_path / "x.distcp")!r}, "wb") as f:
    item = files.write_tensor(f, np.ones((4, 3), np.float32))
assert files.map_tensor({str(tmp_path)!r}, "x.distcp", item["offset"], item["length"], (4, 3)).sum() == 12
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"server-side code imports torch: {out.stdout.strip()[:300]}"
