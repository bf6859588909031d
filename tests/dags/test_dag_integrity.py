"""The DAG files: they import cleanly and fast, hold the tasks, params and placement they
promise, and import nothing heavy at parse time."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

DAG_FILES = sorted((REPO / "dags").glob("*.py"))


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(str(REPO / "dags"))


def test_no_import_errors(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert {"graphtrim_optimize_model", "graphtrim_optimize_model_gpu"} <= set(dagbag.dag_ids)


@pytest.mark.parametrize("dag_id", ["graphtrim_optimize_model", "graphtrim_optimize_model_gpu"])
def test_optimize_dag_shape(dagbag: Any, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    assert set(dag.task_ids) == {
        "plan",
        "variants",
        "export",
        "optimize",
        "quantize",
        "gate",
        "register",
        "promote",
        "summary",
    }
    assert {"model_name", "version", "alias", "variants", "device", "policy", "artifacts"} <= set(
        dag.params
    )
    device = "gpu" if dag_id.endswith("_gpu") else "cpu"
    assert dag.params.get_param("device").resolve(device) == device
    other = "cpu" if device == "gpu" else "gpu"
    with pytest.raises(Exception, match="is not one of"):
        dag.params.get_param("device").resolve(other)
    order = ["export", "optimize", "quantize", "gate", "register", "promote", "summary"]
    for a, b in itertools.pairwise(order):
        assert a in dag.get_task(b).upstream_task_ids or a in {
            t for u in dag.get_task(b).upstream_task_ids for t in dag.get_task(u).upstream_task_ids
        }, (a, b)
    for task in dag.tasks:
        assert task.retries >= 2, task.task_id
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    assert isinstance(dag.get_task("quantize"), MappedOperator)
    assert isinstance(dag.get_task("gate"), MappedOperator)


def test_gpu_stages_are_placed_on_gpu_workers(dagbag: Any) -> None:
    gpu = dagbag.dags["graphtrim_optimize_model_gpu"]
    cpu = dagbag.dags["graphtrim_optimize_model"]
    for task_id in ("quantize", "gate"):
        t = gpu.get_task(task_id)
        kw = t.partial_kwargs
        assert kw["queue"] == "gpu"
        assert kw["pool"] == "graphtrim_gpu"
        pod = kw["executor_config"]["pod_override"]
        base = pod.spec.containers[0]
        assert base.name == "base"
        assert base.resources.limits["nvidia.com/gpu"] == "1"
        c = cpu.get_task(task_id).partial_kwargs
        assert c.get("queue") in (None, "default")
        assert "pod_override" not in (c.get("executor_config") or {})
    # the stages that need no accelerator stay on CPU workers in both DAGs
    for task_id in ("export", "optimize", "register", "promote"):
        assert gpu.get_task(task_id).queue != "gpu"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_parses_fast_and_imports_nothing_heavy(path: Path) -> None:
    code = (
        "import json, sys, time, runpy; t = time.perf_counter(); "
        f"runpy.run_path({str(path)!r}); dt = time.perf_counter() - t; "
        "print(json.dumps({'seconds': dt, 'mods': sorted({m.split('.')[0] for m in sys.modules})}))"
    )
    # airflow itself is imported first: its own import time is not the DAG file's
    warm = "import airflow.sdk, airflow.providers.standard.operators.python; "
    out = subprocess.run(
        [sys.executable, "-c", warm + code], capture_output=True, text=True, check=True
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = {"torch", "onnxruntime", "mlflow", "boto3", "onnx", "onnx_ir", "transformers"}
    assert not heavy & set(doc["mods"]), sorted(heavy & set(doc["mods"]))
    assert doc["seconds"] < 2.0, f"{path.name} took {doc['seconds']:.2f} s to parse"
