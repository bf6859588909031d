"""The DAG files: they import cleanly, hold the tasks, params and placement they promise, and
import nothing heavy at parse time (what keeps them cheap for the scheduler to parse: their
parse time is not asserted here, it depends on the machine's load)."""

from __future__ import annotations

import datetime as dt
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


def test_every_dag_explains_itself_and_every_param(dagbag: Any) -> None:
    """What a person triggering a run by hand reads: the DAG's documentation (its file's
    docstring) and a description of every param of the trigger form."""
    for dag_id, dag in dagbag.dags.items():
        assert dag.doc_md and len(dag.doc_md) > 200, dag_id
        assert dag.doc_md.startswith("graphtrim: "), dag_id
        for name in dag.params:
            described = dag.params.get_param(name).description
            assert described and len(described) > 10, (dag_id, name)


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
        # the settings search: a plan, then a mapped trial task and a select per round
        "tune.plan",
        *(f"tune.{step}_{r}" for r in range(5) for step in ("trial", "select")),
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
    # the rounds follow each other, each trial task mapped over its select's round; quantize
    # reads the last select's search
    for r in range(5):
        trial = dag.get_task(f"tune.trial_{r}")
        assert isinstance(trial, MappedOperator)
        before = "tune.plan" if r == 0 else f"tune.select_{r - 1}"
        # (plan: the run's config)
        assert trial.upstream_task_ids == {before, "export", "optimize", "plan"}
        select = dag.get_task(f"tune.select_{r}")
        assert select.upstream_task_ids == {before, f"tune.trial_{r}", "plan"}
        assert select.trigger_rule == "none_failed"  # a round with no trial is skipped
    assert "tune.select_4" in dag.get_task("quantize").upstream_task_ids


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
    # the settings search's trials run where the variants are built, under the GPU pool
    trial = gpu.get_task("tune.trial_0").partial_kwargs
    assert trial["queue"] == "gpu" and trial["pool"] == "graphtrim_gpu"
    assert trial["executor_config"]["pod_override"].spec.containers[0].resources.limits
    assert cpu.get_task("tune.trial_0").partial_kwargs.get("queue") in (None, "default")
    for task_id in ("tune.plan", "tune.select_0"):  # bookkeeping: no GPU
        assert gpu.get_task(task_id).queue != "gpu"
    # the stages that need no accelerator stay on CPU workers in both DAGs
    for task_id in ("export", "optimize", "register", "promote"):
        assert gpu.get_task(task_id).queue != "gpu"


@pytest.mark.parametrize(
    ("dag_id", "finder", "kind"),
    [
        ("graphtrim_registry_scan", "candidates", "RegistryScanOperator"),
        ("graphtrim_registry_events", "versions", "RegistryEventsOperator"),
    ],
)
def test_registry_dags_trigger_one_optimize_run_per_version_their_operator_finds(
    dagbag: Any, dag_id: str, finder: str, kind: str
) -> None:
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from graphtrim.airflow import registry

    dag = dagbag.dags[dag_id]
    assert set(dag.task_ids) == {finder, "optimize"}
    assert isinstance(dag.get_task(finder), getattr(registry, kind))
    optimize = dag.get_task("optimize")
    assert isinstance(optimize, MappedOperator)
    assert optimize.upstream_task_ids == {finder}
    assert optimize.partial_kwargs["trigger_dag_id"] == "graphtrim_optimize_model"
    # a version already triggered under the same run id is skipped, not run twice
    assert optimize.partial_kwargs["skip_when_already_exists"] is True
    for task in dag.tasks:
        assert task.retries >= 2, task.task_id


def test_registry_scan_takes_its_arguments_from_the_run_params(dagbag: Any) -> None:
    dag = dagbag.dags["graphtrim_registry_scan"]
    scan = dag.get_task("candidates")
    for name in (
        "max_runs",
        "versions_per_model",
        "watch_tag",
        "artifacts",
        "allow_variant_source",
    ):
        assert name in dag.params, name
        assert name in scan.template_fields, name
        assert getattr(scan, name) == "{{ params." + name + " }}", name


def test_param_choices_are_the_cores_and_read_without_importing_it() -> None:
    from graphtrim.airflow.params import preset_choices, variant_choices
    from graphtrim.graph.presets import PRESETS
    from graphtrim.quantize import VARIANTS

    assert preset_choices() == list(PRESETS)
    assert "compact" in preset_choices()
    assert variant_choices() == list(VARIANTS)
    code = (
        "import json, sys; from graphtrim.airflow import params; "
        "c = [params.preset_choices(), params.variant_choices(), params.default_variants()]; "
        "print(json.dumps({'mods': sorted({m.split('.')[0] for m in sys.modules})}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    mods = set(json.loads(out.stdout.strip().splitlines()[-1])["mods"])
    assert not {"numpy", "onnx", "onnx_ir", "onnxruntime", "mlflow", "airflow"} & mods


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_dag_file_imports_nothing_heavy(path: Path) -> None:
    code = (
        "import json, sys, runpy; "
        f"runpy.run_path({str(path)!r}); "
        "print(json.dumps({'mods': sorted({m.split('.')[0] for m in sys.modules})}))"
    )
    # airflow itself is imported first: its own import time is not the DAG file's
    warm = "import airflow.sdk, airflow.providers.standard.operators.python; "
    out = subprocess.run(
        [sys.executable, "-c", warm + code], capture_output=True, text=True, check=True
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    # what the parse time was guarding: a top-level import of model or numeric code makes
    # every parse of the file by the scheduler slow
    heavy = {
        "torch",
        "onnxruntime",
        "mlflow",
        "boto3",
        "onnx",
        "onnx_ir",
        "onnxscript",
        "transformers",
        "numpy",
        "scipy",
        "pandas",
        "sklearn",
    }
    assert not heavy & set(doc["mods"]), sorted(heavy & set(doc["mods"]))


GRAPHTRIM_DAGS = [
    "graphtrim_optimize_model",
    "graphtrim_optimize_model_gpu",
    "graphtrim_registry_events",
    "graphtrim_registry_scan",
]


def _timeouts(dag: Any) -> dict[str, float | None]:
    """task id -> execution_timeout in minutes (mapped tasks: from their partial arguments)."""
    out: dict[str, float | None] = {}
    for task in dag.tasks:
        value = getattr(task, "partial_kwargs", {}).get("execution_timeout", task.execution_timeout)
        out[task.task_id] = value.total_seconds() / 60 if value is not None else None
    return out


def test_every_graphtrim_task_has_an_execution_timeout(dagbag: Any) -> None:
    assert set(GRAPHTRIM_DAGS) <= set(dagbag.dag_ids)
    for dag_id in GRAPHTRIM_DAGS:
        minutes = _timeouts(dagbag.dags[dag_id])
        missing = sorted(t for t, m in minutes.items() if not m)
        assert not missing, (dag_id, missing)
    optimize = _timeouts(dagbag.dags["graphtrim_optimize_model"])
    # the stages whose time grows with the model get hours, the bookkeeping ones minutes
    for long in ("export", "optimize", "quantize", "gate"):
        assert optimize[long] is not None and optimize[long] >= 60, (long, optimize[long])
    for short in ("plan", "variants", "register", "promote", "summary"):
        assert optimize[short] is not None and optimize[short] <= 30, (short, optimize[short])


_PARSE = (
    "import json; from airflow.dag_processing.dagbag import DagBag; "
    f"from tests.dags.test_dag_integrity import _timeouts; b = DagBag({str(REPO / 'dags')!r}); "
    "print(json.dumps({'errors': {k: str(v)[-300:] for k, v in b.import_errors.items()}, "
    "'minutes': {d: _timeouts(b.dags[d]) for d in b.dag_ids}}))"
)


def _parse_with(env: dict[str, str]) -> dict[str, Any]:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHTRIM_TASK_TIMEOUT")}
    out = subprocess.run(
        [sys.executable, "-c", _PARSE],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**full, **env},
    )
    doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_task_timeouts_come_from_the_environment_when_the_dags_are_parsed() -> None:
    doc = _parse_with(
        {"GRAPHTRIM_TASK_TIMEOUT_MINUTES": "7", "GRAPHTRIM_TASK_TIMEOUT_MINUTES_EXPORT": "300"}
    )
    assert doc["errors"] == {}
    for dag_id in GRAPHTRIM_DAGS:
        for task_id, minutes in doc["minutes"][dag_id].items():
            want = 300 if dag_id.startswith("graphtrim_optimize") and task_id == "export" else 7
            assert minutes == want, (dag_id, task_id, minutes)
    # a value that is not a positive number of minutes is an import error that names it
    bad = _parse_with({"GRAPHTRIM_TASK_TIMEOUT_MINUTES_QUANTIZE": "0"})
    assert any("GRAPHTRIM_TASK_TIMEOUT_MINUTES_QUANTIZE" in e for e in bad["errors"].values()), bad


def _optimize_dag(device: str) -> Any:
    """The optimize DAG built again from its file, with the stages as they are now."""
    import runpy

    code = runpy.run_path(str(REPO / "dags" / "graphtrim_optimize_model.py"))
    return code["optimize_dag"](f"graphtrim_optimize_model_{device}_again", device)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_stage_added_to_the_list_is_a_task_of_the_optimize_dag(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """The stage tasks are derived from ``STAGES``: a per-variant stage after validate is mapped
    over the gate task's instances (one per variant) and placed like them; a stage after promote
    reads the records it names. Nothing but the list (and the new stages' timeouts) changes."""
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from graphtrim.airflow import timeouts
    from graphtrim.airflow.operators import GraphtrimStageOperator
    from graphtrim.stages import STAGES, Stage

    names = [s.name for s in STAGES]
    at = names.index("validate") + 1
    inspect = Stage("inspect", ("export", "validate"), "inspect a variant", True, True)
    judge = Stage("judge", ("optimize", "validate", "register"), "judge the run")
    stages = (*STAGES[:at], inspect, *STAGES[at:], judge)
    monkeypatch.setattr("graphtrim.stages.STAGES", stages)
    monkeypatch.setitem(timeouts.DEFAULT_MINUTES, "inspect", 42)
    monkeypatch.setitem(timeouts.DEFAULT_MINUTES, "judge", 43)
    dag = _optimize_dag(device)

    task = dag.get_task("inspect")
    assert isinstance(task, MappedOperator)
    assert issubclass(task.operator_class, GraphtrimStageOperator)
    assert task.operator_class.stage_name == "inspect"
    assert {"exported", "validated"} <= set(task.operator_class.template_fields)
    assert task.upstream_task_ids == {"plan", "export", "gate"}
    mapped: Any = task.expand_input.value
    assert set(mapped) == {"validated"}
    assert mapped["validated"].operator.task_id == "gate"
    assert task.partial_kwargs["exported"].operator.task_id == "export"
    assert task.partial_kwargs["execution_timeout"].total_seconds() == 42 * 60
    gate = dag.get_task("gate").partial_kwargs
    for key in ("device", "queue", "pool", "executor_config"):
        assert task.partial_kwargs.get(key) == gate.get(key), key
    assert task.partial_kwargs["device"] == device

    task = dag.get_task("judge")
    assert not isinstance(task, MappedOperator)
    assert task.stage == "judge"
    assert task.upstream_task_ids == {"plan", "optimize", "gate", "register"}
    assert task.execution_timeout.total_seconds() == 43 * 60
    assert task.device == "cpu"
    # the stages that were there keep their tasks and edges
    assert dag.get_task("register").upstream_task_ids == {"plan", "optimize", "gate"}
    assert dag.get_task("gate").upstream_task_ids == {"plan", "export", "quantize"}


def test_the_records_of_added_stages_are_read_by_the_stages_after_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage added to the list carries its record to the stages that read it: one mapped
    over it in the same chain, one after the chain and one after promote."""
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    from graphtrim.airflow import timeouts
    from graphtrim.stages import STAGES, Stage

    names = [s.name for s in STAGES]
    at = names.index("validate") + 1
    added = (
        Stage("inspect", ("export", "validate"), "inspect a variant", True, True),
        Stage("probe", ("inspect",), "probe a variant", True, True),
    )
    audit = Stage("audit", ("promote", "probe"), "audit the promotion")
    stages = (*STAGES[:at], *added, *STAGES[at:], audit)
    monkeypatch.setattr("graphtrim.stages.STAGES", stages)
    for name in ("inspect", "probe"):
        monkeypatch.setitem(timeouts.DEFAULT_MINUTES, name, 5)
    dag = _optimize_dag("gpu")  # "audit" has no timeout entry: it gets the long default

    probe = dag.get_task("probe")
    assert isinstance(probe, MappedOperator)
    assert probe.upstream_task_ids == {"plan", "inspect"}
    mapped: Any = probe.expand_input.value
    assert set(mapped) == {"inspected"}
    assert mapped["inspected"].operator.task_id == "inspect"
    assert "inspected" in probe.operator_class.template_fields
    audit_task = dag.get_task("audit")
    assert audit_task.upstream_task_ids == {"plan", "promote", "probe"}
    assert audit_task.execution_timeout == dt.timedelta(minutes=timeouts.UNLISTED_MINUTES)
    assert {"promoted", "probed"} <= set(audit_task.template_fields)
    assert audit_task.promoted.operator.task_id == "promote"
    assert audit_task.probed.operator.task_id == "probe"
