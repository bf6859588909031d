"""The Kubeflow pipeline: compiled offline, its structure checked, and its steps' exact command
lines run the way KFP's launcher runs them (placeholders resolved, outputs read from files)
against an embedded MLflow registry."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from optimizer_core.cli import main
from optimizer_core.examples.digits import DigitsTask
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


def test_gpu_pipeline_requests_gpus_for_quantize_and_gate(
    compiled: dict[str, dict[str, Any]],
) -> None:
    for device, wanted in (("gpu", True), ("cpu", False)):
        executors = compiled[device]["deploymentSpec"]["executors"]
        for name, ex in executors.items():
            accel = (ex["container"].get("resources") or {}).get("accelerator")
            if name in ("exec-quantize", "exec-gate") and wanted:
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
