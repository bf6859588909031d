"""Layering: the core never imports an orchestrator; the graph passes import neither MLflow nor
boto3; the import graph has no circle and no arrow to a higher layer; DAGs import no core module. Checked in a clean interpreter so that nothing imported by other tests can hide a leak."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.package_tree import module_files, package_dirs

FORBIDDEN = {
    "graphtrim": {"airflow", "kfp"},
    "graphtrim.cli": {"airflow", "kfp", "torch"},
    "graphtrim.optimize_file": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "graphtrim.graph.optimizer": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "graphtrim.graph.presets": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "graphtrim.verify": {"airflow", "kfp", "mlflow", "boto3", "torch"},
}


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_module_imports_no_forbidden_layer(module):
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    leaked = FORBIDDEN[module] & loaded
    assert not leaked, f"{module} imports {sorted(leaked)}"


def test_graph_passes_import_only_ir_numpy_onnx_ort():
    code = (
        "import json, sys, pkgutil, importlib, graphtrim.graph.passes as p; "
        "[importlib.import_module('graphtrim.graph.passes.' + m.name) for m in pkgutil.iter_modules(p.__path__)]; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not ({"mlflow", "boto3", "airflow", "torch", "kfp"} & loaded)


def test_cli_starts_without_importing_an_orchestrator_or_torch():
    """Building the parser (every command does) loads the adapters' command entry points but
    not their heavy libraries."""
    code = (
        "import json, sys; from graphtrim.cli import build_parser; build_parser(); "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not {"kfp", "airflow", "torch", "mlflow"} & loaded, sorted(loaded)


# ---------------------------------------------------------------- the import graph
#
# Layers, lowest first. A module may import (at module level or inside a function) only modules
# of its own layer or of a lower one, and the whole graph has no circle. A module is placed by
# the longest prefix listed here; a new module outside every prefix fails the test until it is
# given a layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "errors and helpers",
        (
            "graphtrim",
            "graphtrim.errors",
            "graphtrim.redact",
            "graphtrim.isolation",
            "graphtrim.forkserver",
            "graphtrim.lazy_sympy",
            "graphtrim.hashing",
            "graphtrim.faults",
            "graphtrim.scratch",
            "graphtrim.lazy",
            "graphtrim.dtypes",
            "graphtrim.run_params",
        ),
    ),
    ("IR I/O", ("graphtrim.modelio", "graphtrim.runtime")),
    ("graph", ("graphtrim.graph",)),
    ("verify", ("graphtrim.verify",)),
    (
        "file optimizer and targets",
        ("graphtrim.stats", "graphtrim.ort_target", "graphtrim.optimize_file"),
    ),
    ("data", ("graphtrim.data", "graphtrim.data_check", "graphtrim.npz")),
    ("quantize and gates", ("graphtrim.quantize", "graphtrim.gates")),
    ("tuning search", ("graphtrim.tune",)),
    (
        "exporters and integrations",
        (
            "graphtrim.integrations",
            "graphtrim.exporter",
            "graphtrim.torch_simplify",
            "graphtrim.promotion",
        ),
    ),
    ("stages", ("graphtrim.stages",)),
    ("example models", ("graphtrim.examples",)),
    ("CLI", ("graphtrim.cli",)),
    ("orchestrator adapters", ("graphtrim.airflow", "graphtrim.kubeflow")),
    ("DAGs", ("dags",)),
    ("the demo", ("graphtrim.demo",)),
]

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = next(i for i, (name, _) in enumerate(LAYERS) if name == "orchestrator adapters")


def _modules() -> dict[str, Path]:
    """Every module by the name it is imported as: the distribution's (``graphtrim``, whose
    folders ``pyproject.toml`` names) and the DAG files (``dags.NAME``)."""
    found = module_files()
    for path in sorted((ROOT / "dags").glob("*.py")):
        found[f"dags.{path.stem}"] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` among the project's own modules, lazy imports included.
    ``from P import name`` points at ``P.name`` when that is a module, else at ``P``; a module's
    own parent packages are left out (Python imports them first anyway)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    origin = node.module or ""
                for alias in node.names:
                    child = f"{origin}.{alias.name}"
                    targets.append(child if child in modules else origin)
            for target in targets:
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                name = ".".join(parts)
                if name and name != module and name not in ancestors:
                    edges[module].add(name)
    return edges


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # the core's package itself (its ``__init__``) is placed by name only
            nested = prefix != "graphtrim" and module.startswith(prefix + ".")
            if module == prefix or nested:
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_import_graph_has_no_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer():
    upward = []
    for module, targets in import_graph().items():
        own = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(f"{module} ({LAYERS[own][0]}) -> {target} ({LAYERS[theirs][0]})")
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_dags_compose_operators_only():
    """A DAG file imports the orchestrator adapters, never the core."""
    leaks = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.startswith("dags")
        for target in sorted(targets)
        if target.split(".")[0] == "graphtrim" and layer_of(target) != ADAPTERS
    ]
    assert not leaks, "DAGs importing the core:\n" + "\n".join(leaks)


def test_the_checks_see_a_circle_an_upward_arrow_and_a_dag_import():
    """The checks above on a made-up graph: each finds what it looks for."""
    graph = {
        "graphtrim.graph.a": {"graphtrim.verify.b"},
        "graphtrim.verify.b": {"graphtrim.graph.a"},
        "dags.x": {"graphtrim.errors"},
    }
    assert cycles(graph) == [["graphtrim.graph.a", "graphtrim.verify.b"]]
    assert layer_of("graphtrim.graph.a") < layer_of("graphtrim.verify.b")
    assert layer_of("graphtrim.graph.passes.cse") == layer_of("graphtrim.graph")
    assert layer_of("dags.x") > layer_of("graphtrim.airflow.hooks")
    assert layer_of("graphtrim.unplaced") is None


# ---------------------------------------------------------------- import names
#
# The folders optimizer_core/ and operators/ install as the package graphtrim (pyproject.toml's
# [tool.setuptools]). In a checkout the folders are importable under their own names too (the
# repository root is on sys.path), so a module spelt with a folder's name would work in the tests
# and fail where the wheel is installed.
OLD_NAME = re.compile(r"(?<![\w./-])(optimizer_core|operators)\.[a-z_]")


def test_every_source_folder_is_a_listed_package():
    listed = {folder.resolve() for folder in package_dirs().values()}
    on_disk = {
        path.parent.resolve()
        for top in ("optimizer_core", "operators")
        for path in (ROOT / top).rglob("*.py")
    }
    missing = sorted(str(p.relative_to(ROOT)) for p in on_disk - listed)
    assert not missing, f"folders the wheel would leave out (add them to pyproject.toml): {missing}"


def test_no_module_is_named_by_its_folder():
    tracked = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".toml", ".yaml", ".yml", ".md", ".cfg", ".txt"}:
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OLD_NAME.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "modules named by their folder (import them as graphtrim...):\n" + "\n".join(
        found
    )


def test_the_old_names_check_sees_a_folder_name():
    core, adapters = "optimizer_core", "operators"  # spelt apart: this file is searched too
    assert OLD_NAME.search(f'function="{core}.stages.export:export"')
    assert OLD_NAME.search(f"from {adapters}.airflow import hooks")
    assert not OLD_NAME.search("from airflow.providers.standard.operators.python import x")
    assert not OLD_NAME.search("see optimizer_core/graph/passes/cse.py")
    assert not OLD_NAME.search("from tests.optimizer_core.graph import helpers")


def test_the_installed_names_are_the_ones_imported():
    """Importing the adapters and the CLI loads every module under ``graphtrim`` alone."""
    code = (
        "import json, sys, graphtrim.cli, graphtrim.airflow.operators, graphtrim.kubeflow.cli; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "graphtrim" in loaded
    assert not {"optimizer_core", "operators"} & loaded
