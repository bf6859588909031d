"""The compiled Kubeflow pipeline executed by KFP's own local runner (``kfp.local``,
``SubprocessRunner``: no cluster, no Docker) on the digits model registered in a real MLflow
server, its models in S3 (moto): every step's command runs as KFP runs it, the ``ParallelFor``
loops and their ``dsl.Collected`` records included."""

from __future__ import annotations

import builtins
import inspect
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask
from tests.conftest import BUCKET
from tests.servers import register_onnx

pytest.importorskip("kfp")


pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MODEL = "digits-kfp-local"
VARIANTS = ["graph", "int8-static"]
IMAGE = "python:3.11"  # not pulled: the SubprocessRunner runs the command here


@pytest.fixture
def local_kfp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``kfp.local`` with the ``SubprocessRunner`` in this environment, its outputs under a
    folder of this test. The runner runs lightweight Python components only and refuses a
    container component before it starts; graphtrim's steps are container components whose
    command (``graphtrim``) is installed here, so that one check is lifted and each step's
    command line runs as a process of this machine (the image is not pulled)."""
    from kfp import local
    from kfp.local import subprocess_task_handler

    monkeypatch.setattr(
        subprocess_task_handler.SubprocessTaskHandler,
        "validate_not_container_component",
        lambda self, full_command: None,
    )
    # the step's command, from this environment
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    monkeypatch.delenv("GRAPHTRIM_POLICY", raising=False)
    # the steps' temporary folders (a lightweight component's `mktemp -d`) and kfp.local's
    # workspace in this test's folder, not left in the system's
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp-local"),
        workspace_root=str(tmp_path / "kfp-workspace"),
        raise_on_error=True,
    )
    # kfp.local swaps ``builtins.print`` for one that indents (and the root logger's handlers
    # for its own) while a task runs; where it does not put them back, every later test of
    # this process would print indented: the process gets its own back after the test
    print_, root = builtins.print, logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield tmp_path / "kfp-local"
    finally:
        builtins.print = print_
        root.handlers[:] = handlers
        root.setLevel(level)


def _arguments(servers: dict[str, str], digits_task: DigitsTask, **over: Any) -> dict[str, Any]:
    return {
        "model_uri": f"models:/{MODEL}/1",
        "tracking_uri": servers["mlflow"],
        "artifacts": f"s3://{BUCKET}/kfp-local",
        "s3_endpoint_url": servers["s3"],
        "variants": VARIANTS,
        # the steps' wiring is what is checked, not a variant's speed on a loaded machine
        "policy": json.dumps(
            {
                "variants": {
                    v: {"latency": {"min_speedup": None, "runs": 20, "warmup": 3}} for v in VARIANTS
                }
            }
        ),
        "calibration": str(digits_task.calibration),
        "eval_data": str(digits_task.eval),
        **over,
    }


class Steps:
    """The compiled pipeline's components (one per stage, and the search's), each called under
    ``kfp.local``: KFP resolves the step's placeholders, runs its command, and reads back its
    output parameters and artifacts."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        from graphtrim.kubeflow.parameters import CONFIG
        from graphtrim.kubeflow.pipeline import (
            stage_component,
            step_name,
            tune_components,
        )
        from graphtrim.stages import STAGES

        # the pipeline's defaults, then the run's arguments
        self.config = {
            c.name: c.default for c in CONFIG if c.default is not inspect.Parameter.empty
        }
        self.config |= {k: v for k, v in arguments.items() if k != "model_uri"}
        self.components = {
            step_name(s): stage_component(STAGES, s, IMAGE, "cpu") for s in STAGES
        } | {f"tune-{k}": c for k, c in tune_components(IMAGE, "cpu").items()}

    def __call__(self, name: str, **inputs: Any) -> Any:
        return self.components[name](**inputs, **self.config)


def test_kfp_local_runs_each_step_of_the_compiled_pipeline(
    local_kfp: Path,
    servers: dict[str, str],
    digits_task: DigitsTask,
) -> None:
    """Every step's component, as compiled, run by kfp.local in the order and with the inputs
    the pipeline's DAG gives it: the loop over the variants (``ParallelFor``) and the list of
    their gate records (``dsl.Collected``) are laid out here, as the compiled pipeline's
    structure (tests/operators/test_kubeflow.py) wires them (see
    docs/getting-started/kubeflow.md for what kfp.local's own loops do)."""
    import mlflow

    register_onnx(servers["mlflow"], digits_task.model, MODEL)
    arguments = _arguments(servers, digits_task)
    step = Steps(arguments)
    export = step("export", model_uri=arguments["model_uri"])
    exported = export.outputs["record"]
    optimized = step("optimize", exported=exported).outputs["record"]
    records = {"exported": exported, "optimized": optimized}
    # no search asked: the plan passes none on and its first round is empty
    plan = step("tune-plan", **records)
    assert json.loads(plan.outputs["search"]) is None and plan.outputs["batch"] == []
    gates = []
    for variant in arguments["variants"]:  # the ParallelFor over the run's variants
        quantized = step("quantize", **records, variant=variant, tuned=plan.outputs["search"])
        record = quantized.outputs["record"]
        assert list(json.loads(record)["variants"]) == [variant]
        gate = step("gate", exported=exported, quantized=record)
        verdict = json.loads(gate.outputs["record"])["variants"][variant]
        assert verdict["passed"], verdict
        # the KFP outputs: the variant's evaluation report and its gate numbers
        report, metrics = gate.outputs["report"], gate.outputs["metrics"]
        html = Path(report.path).read_text()
        assert html.lstrip().lower().startswith("<!doctype html") and variant in html
        assert metrics.metadata[f"{variant}.passed"] == 1.0
        assert metrics.metadata[f"{variant}.speedup"] == pytest.approx(
            verdict["metrics"]["speedup"]
        )
        gates.append(gate.outputs["record"])
    # dsl.Collected: the gate records as one list
    register = step("register", exported=exported, optimized=optimized, validated=gates)
    registered = json.loads(register.outputs["record"])["registered"]
    assert set(registered) == set(VARIANTS), register.outputs["record"]
    numbers = register.outputs["metrics"].metadata
    assert numbers["registered"] == 2.0 and numbers["failed"] == 0.0
    comparison = Path(register.outputs["report"].path).read_text()
    assert all(v in comparison for v in VARIANTS)
    promote = step(
        "promote", exported=exported, validated=gates, registered=register.outputs["record"]
    )
    assert json.loads(promote.outputs["record"])["champion"]["moved"] is True

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    for variant, entry in registered.items():
        assert numbers[f"{variant}.version"] == float(entry["version"])
        tags = client.get_model_version(MODEL, entry["version"]).tags
        assert tags["graphtrim.variant"] == variant
        assert tags["graphtrim.source.version"] == "1"
        assert tags["graphtrim.orchestrator_run_id"].startswith("kfp:"), tags
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.tags["graphtrim.variant"] in VARIANTS
    # the models went to S3, under the run's prefix
    import boto3

    listed = boto3.client("s3", endpoint_url=servers["s3"]).list_objects_v2(
        Bucket=BUCKET, Prefix="kfp-local/"
    )
    assert listed.get("KeyCount", 0) > 0
    # a retried register step (the same inputs) registers nothing new
    again = step("register", exported=exported, optimized=optimized, validated=gates)
    assert all(not r["created"] for r in json.loads(again.outputs["record"])["registered"].values())


# ---------------------------------------------------------------- what kfp.local does with loops


def test_kfp_local_collects_a_loop_and_fails_on_a_loop_of_no_iterations(local_kfp: Path) -> None:
    """What docs/getting-started/kubeflow.md says of kfp.local's loops: a ``dsl.Collected``
    of a ``ParallelFor`` gets the iterations' outputs in order, and one of a loop over an empty
    list fails the step that reads it (the case of a search round after the search ended).
    When kfp changes this, the page changes with it."""
    from tests.operators.kfp_loops import loop_then_collect

    assert loop_then_collect(items=["a", "b"]).output == "2:A,B"
    with pytest.raises(ValueError, match="for-loop-1' not found"):
        loop_then_collect(items=[])
