"""The Kubeflow pipeline: compiled offline, its structure checked, and its steps' exact command
lines run the way KFP's launcher runs them (placeholders resolved, outputs read from files)
against an embedded MLflow registry."""

from __future__ import annotations

import io
import json
import re
import tokenize
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from optimizer_core.cli import main
from optimizer_core.examples.digits import DigitsTask
from optimizer_core.stages import STAGES, Stage
from tests.servers import register_onnx

pytest.importorskip("kfp")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("kfp")
    for device in ("cpu", "gpu"):
        path = folder / f"{device}.yaml"
        assert main(["kfp", "compile", "-o", str(path), "--device", device, "--image", "gt:1"]) == 0
        out[device] = yaml.safe_load(path.read_text())
    return out


def _loop(doc: dict[str, Any]) -> dict[str, Any]:
    name = next(t for t in doc["root"]["dag"]["tasks"] if t.startswith("for-loop"))
    return doc["root"]["dag"]["tasks"][name] | {"_name": name}


def test_pipeline_structure(compiled: dict[str, dict[str, Any]]) -> None:
    doc = compiled["cpu"]
    tasks = doc["root"]["dag"]["tasks"]
    assert {"export", "optimize", "register", "promote"} <= set(tasks)
    loop = _loop(doc)
    inner = doc["components"][loop["componentRef"]["name"]]["dag"]["tasks"]
    assert set(inner) == {"quantize", "gate"}
    params = doc["root"]["inputDefinitions"]["parameters"]
    assert {"model_uri", "tracking_uri", "artifacts", "variants", "policy"} <= set(params)
    assert params["variants"]["defaultValue"] == ["graph", "int8-dynamic", "int8-static"]
    # build steps cached (their inputs, the config, are the key); registry steps never
    assert tasks["export"]["cachingOptions"] == {"enableCache": True}
    assert tasks["register"]["cachingOptions"] in ({}, {"enableCache": False})
    assert tasks["promote"]["cachingOptions"] in ({}, {"enableCache": False})
    for name in ("export", "optimize", "register", "promote"):
        assert tasks[name]["retryPolicy"]["maxRetryCount"] == 2
    for ex in doc["deploymentSpec"]["executors"].values():
        assert ex["container"]["image"] == "gt:1"
        assert ex["container"]["command"] == ["graphtrim"]


def _steps(doc: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str | None]]:
    """Every step of a compiled pipeline: its task and the loop it runs in (None: the root)."""
    out: dict[str, tuple[dict[str, Any], str | None]] = {}
    for name, task in doc["root"]["dag"]["tasks"].items():
        if name.startswith("for-loop"):
            body = doc["components"][task["componentRef"]["name"]]["dag"]["tasks"]
            out |= {n: (t, name) for n, t in body.items()}
        else:
            out[name] = (task, None)
    return out


def _producer(source: dict[str, Any]) -> str:
    """The step whose record a task input is: a task's output, the loop's input or output."""
    if "taskOutputParameter" in source:
        ref = source["taskOutputParameter"]
        key = ref["outputParameterKey"]
        return ref["producerTask"] if key == "record" else key
    return str(source["componentInputParameter"])


def _check_steps_are_stages(doc: dict[str, Any], stages: tuple[Stage, ...]) -> None:
    from operators.kubeflow.pipeline import step_name
    from optimizer_core.stages import record_arg as record_parameter

    steps = _steps(doc)
    by_name = {s.name: s for s in stages}
    assert sorted(steps) == sorted(step_name(s) for s in stages)
    executors = doc["deploymentSpec"]["executors"]
    loop_of: dict[str, str | None] = {}
    for i, stage in enumerate(stages):
        task, loop = steps[step_name(stage)]
        loop_of[stage.name] = loop
        assert (loop is not None) == stage.per_variant, stage.name
        if stage.per_variant and i and stages[i - 1].per_variant:
            assert loop == loop_of[stages[i - 1].name], "one loop per run of per-variant stages"
        # the DAG's edges are the stage's inputs, all of earlier stages
        assert {s.name for s in stages[:i]} >= set(stage.inputs)
        inputs = task["inputs"]["parameters"]
        for name in stage.inputs:
            source = inputs[record_parameter(name)]
            step = step_name(by_name[name])
            assert _producer(source) in (step, f"pipelinechannel--{step}-record"), source
        args = executors[f"exec-{step_name(stage)}"]["container"]["args"]
        assert args[:3] == ["pipeline", "stage", stage.name]
        assert [
            json.loads(args[k + 1])["Concat"] for k, a in enumerate(args) if a == "--input"
        ] == [
            [f"{n}=", f"{{{{$.inputs.parameters['{record_parameter(n)}']}}}}"] for n in stage.inputs
        ]
        # a per-variant stage is given its variant unless it reads a record of its own loop
        own = any(loop is not None and loop_of.get(n) == loop for n in stage.inputs)
        assert ("--only" in args) == (stage.per_variant and not own), stage.name
        if stage.writes_registry:
            assert task["cachingOptions"] in ({}, {"enableCache": False}), stage.name
        else:
            assert task["cachingOptions"] == {"enableCache": True}, stage.name
        assert task["retryPolicy"]["maxRetryCount"] == 2
        resources = executors[f"exec-{step_name(stage)}"]["container"].get("resources", {})
        assert ("cpuRequest" in resources) == stage.on_device, stage.name


def test_steps_are_the_stages(
    compiled: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One step per stage of ``STAGES``, wired by the stages' inputs; a stage added to the list
    is a step, with no change to the Kubeflow module."""
    import optimizer_core.stages
    from operators.kubeflow.pipeline import compile_pipeline

    _check_steps_are_stages(compiled["cpu"], STAGES)
    _check_steps_are_stages(compiled["gpu"], STAGES)
    more = (
        *STAGES[:4],
        Stage("benchmark", ("quantize",), "time one variant", per_variant=True, on_device=True),
        *STAGES[4:],
        Stage("report", ("export", "benchmark"), "summarize the run"),
    )
    monkeypatch.setattr(optimizer_core.stages, "STAGES", more)
    doc = yaml.safe_load(Path(compile_pipeline(tmp_path / "more.yaml", image="gt:1")).read_text())
    _check_steps_are_stages(doc, more)
    assert set(_loop(doc)["dependentTasks"]) == {"export", "optimize"}
    report = doc["components"]["comp-report"]["inputDefinitions"]["parameters"]
    assert report["benchmarked"]["parameterType"] == "LIST"  # all variants' records


def test_config_parameters_are_declared_once() -> None:
    """The run's configuration is one list in the Kubeflow module, used for the pipeline's
    parameters and every step's command line."""
    import operators.kubeflow.pipeline as module

    config = (
        "tracking_uri",
        "artifacts",
        "s3_endpoint_url",
        "variants",
        "preset",
        "policy",
        "calibration",
        "eval_data",
    )
    tokens = Counter(
        t.string.strip("\"'")
        for t in tokenize.generate_tokens(io.StringIO(Path(module.__file__).read_text()).readline)
        if t.type in (tokenize.NAME, tokenize.STRING)
    )
    assert {name: tokens[name] for name in config} == dict.fromkeys(config, 1)


def test_gpu_pipeline_requests_gpus_for_quantize_and_gate(
    compiled: dict[str, dict[str, Any]],
) -> None:
    for device, wanted in (("gpu", True), ("cpu", False)):
        executors = compiled[device]["deploymentSpec"]["executors"]
        for name, ex in executors.items():
            accel = (ex["container"].get("resources") or {}).get("accelerator")
            if name in ("exec-quantize", "exec-gate") and wanted:
                assert accel is not None, name
                assert (
                    accel["resourceType"] == "nvidia.com/gpu" and int(accel["resourceCount"]) == 1
                )
                assert "--device" in ex["container"]["args"]
                assert (
                    ex["container"]["args"][ex["container"]["args"].index("--device") + 1] == "gpu"
                )
            else:
                assert accel is None, (device, name)


# ---------------------------------------------------------------------------- launcher


def _resolve(arg: str, inputs: dict[str, Any], output: Path) -> str:
    """What KFP's launcher does to one argument: placeholders -> values (lists as JSON)."""
    if arg.startswith('{"Concat"'):
        return "".join(_resolve(part, inputs, output) for part in json.loads(arg)["Concat"])

    def value(m: re.Match[str]) -> str:
        v = inputs[m.group(1)]
        return v if isinstance(v, str) else json.dumps(v)

    arg = re.sub(r"\{\{\$\.inputs\.parameters\['([a-z_]+)'\]\}\}", value, arg)
    arg = arg.replace("{{$.outputs.parameters['record'].output_file}}", str(output))
    return arg.replace("{{$.pipeline_job_uuid}}", "job-1")


def _run_step(doc: dict[str, Any], step: str, inputs: dict[str, Any], tmp: Path) -> str:
    args = doc["deploymentSpec"]["executors"][f"exec-{step}"]["container"]["args"]
    out = tmp / f"{step}-{len(list(tmp.iterdir()))}.json"
    resolved = [_resolve(a, inputs, out) for a in args]
    assert main(resolved) == 0, (step, resolved)
    return out.read_text()


@pytest.mark.slow
def test_compiled_steps_run_the_pipeline(
    compiled: dict[str, dict[str, Any]], digits_task: DigitsTask, tmp_path: Path
) -> None:
    import mlflow

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_onnx(tracking, digits_task.model, "digits-kfp", artifact_dir=tmp_path / "mlruns")
    doc = compiled["cpu"]
    params = {
        "model_uri": "models:/digits-kfp/1",
        "tracking_uri": tracking,
        "artifacts": str(tmp_path / "artifacts"),
        "s3_endpoint_url": "",
        "variants": ["graph", "int8-static"],
        "preset": "default",
        "policy": json.dumps(
            {"variants": {"graph": {"latency": {"min_speedup": 0.5, "runs": 60}}}}
        ),
        "calibration": str(digits_task.calibration),
        "eval_data": str(digits_task.eval),
    }
    work = tmp_path / "outputs"
    work.mkdir()
    exported = _run_step(doc, "export", params, work)
    optimized = _run_step(doc, "optimize", {**params, "exported": exported}, work)
    gates = []
    for variant in params["variants"]:
        quantized = _run_step(
            doc,
            "quantize",
            {**params, "exported": exported, "optimized": optimized, "variant": variant},
            work,
        )
        assert list(json.loads(quantized)["variants"]) == [variant]
        gates.append(
            _run_step(doc, "gate", {**params, "exported": exported, "quantized": quantized}, work)
        )
    # dsl.Collected: the gate records as one list parameter
    registered = _run_step(
        doc,
        "register",
        {**params, "exported": exported, "optimized": optimized, "validated": gates},
        work,
    )
    promoted = _run_step(
        doc,
        "promote",
        {**params, "exported": exported, "validated": gates, "registered": registered},
        work,
    )
    reg = json.loads(registered)["registered"]
    assert set(reg) == {"graph", "int8-static"}, json.loads(registered)
    assert json.loads(promoted)["champion"]["moved"] is True
    client = mlflow.MlflowClient(tracking, tracking)
    for variant, rec in reg.items():
        tags = client.get_model_version("digits-kfp", rec["version"]).tags
        assert tags["graphtrim.variant"] == variant
        assert tags["graphtrim.orchestrator_run_id"] == "kfp:job-1"
    # a retried register step (same inputs) registers nothing new
    again = _run_step(
        doc,
        "register",
        {**params, "exported": exported, "optimized": optimized, "validated": gates},
        work,
    )
    assert all(not r["created"] for r in json.loads(again)["registered"].values())
