"""Layering: the core never imports an orchestrator; the graph passes import neither MLflow nor
boto3. Checked in a clean interpreter so that nothing imported by other tests can hide a leak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = {
    "optimizer_core": {"airflow", "kfp"},
    "optimizer_core.cli": {"airflow", "kfp", "torch"},
    "optimizer_core.optimize_file": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "optimizer_core.graph.optimizer": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "optimizer_core.graph.presets": {"airflow", "kfp", "mlflow", "boto3", "torch"},
    "optimizer_core.verify": {"airflow", "kfp", "mlflow", "boto3", "torch"},
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
        "import json, sys, pkgutil, importlib, optimizer_core.graph.passes as p; "
        "[importlib.import_module('optimizer_core.graph.passes.' + m.name) for m in pkgutil.iter_modules(p.__path__)]; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not ({"mlflow", "boto3", "airflow", "torch", "kfp"} & loaded)


def test_cli_starts_without_importing_an_orchestrator_or_torch():
    """Building the parser (every command does) loads the adapters' command entry points but
    not their heavy libraries."""
    code = (
        "import json, sys; from optimizer_core.cli import build_parser; build_parser(); "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not {"kfp", "airflow", "torch", "mlflow"} & loaded, sorted(loaded)
