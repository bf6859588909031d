"""The Kubeflow pipeline: compiled offline, its structure checked, and its steps' exact command
lines run the way KFP's launcher runs them (placeholders resolved, outputs read from files)
against an embedded MLflow registry."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest
import yaml

import graphtrim.kubeflow.outputs as outputs_module
from graphtrim.cli import main
from graphtrim.errors import GraphtrimError
from graphtrim.examples.digits import DigitsTask
from graphtrim.stages import STAGES, Stage
from tests.servers import register_onnx

pytest.importorskip("kfp")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("kfp")
    for device in ("cpu", "gpu"):
        path = folder / f"{device}.yaml"
        assert main(["kfp", "compile", "-o", str(path), "--device", device, "--image", "gt:1"]) == 0
        out[device] = _documents(path)
    return out


# the stages whose records carry reports (the gates' evaluations, the run's comparison)
REPORTING = {"validate", "register"}


def _documents(path: Path) -> dict[str, Any]:
    """A compiled pipeline: its spec, with the Kubernetes platform spec (the second document)
    under ``"platform"``."""
    spec, *rest = yaml.safe_load_all(path.read_text())
    return {**spec, "platform": rest[0] if rest else {}}


def _stage_args(args: list[str]) -> list[str]:
    """The ``graphtrim pipeline stage`` arguments of a step's command line: a reporting step's
    (``kfp step --executor-input {{$}} NAME ...``) too."""
    if args[:2] == ["kfp", "step"]:
        assert args[2:4] == ["--executor-input", "{{$}}"], args[:5]
        return ["pipeline", "stage", *args[4:]]
    return args


def _body(doc: dict[str, Any], loop: dict[str, Any]) -> dict[str, Any]:
    return doc["components"][loop["componentRef"]["name"]]["dag"]["tasks"]


def _loops(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The pipeline's ``ParallelFor`` loops, in the order they were added."""
    tasks = doc["root"]["dag"]["tasks"]
    names = sorted((t for t in tasks if t.startswith("for-loop")), key=lambda n: int(n[9:]))
    return [tasks[n] | {"_name": n} for n in names]


def _loop(doc: dict[str, Any]) -> dict[str, Any]:
    """The loop over the variants (the others are the settings search's rounds)."""
    return next(
        loop for loop in _loops(doc) if not any(t.startswith("tune-") for t in _body(doc, loop))
    )


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
        if name.startswith("tune-"):
            continue  # the settings search's steps, not stages (test_the_search_steps_...)
        if name.startswith("for-loop"):
            body = doc["components"][task["componentRef"]["name"]]["dag"]["tasks"]
            out |= {n: (t, name) for n, t in body.items() if not n.startswith("tune-")}
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
    from graphtrim.kubeflow.pipeline import step_name
    from graphtrim.stages import record_arg as record_parameter

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
        raw = executors[f"exec-{step_name(stage)}"]["container"]["args"]
        args = _stage_args(raw)
        assert args[:3] == ["pipeline", "stage", stage.name]
        # a stage whose record carries reports outputs them (and its numbers) as artifacts
        reporting = stage.name in REPORTING
        assert (raw[:2] == ["kfp", "step"]) == reporting, stage.name
        outputs = doc["components"][f"comp-{step_name(stage)}"]["outputDefinitions"]
        kinds = {
            n: a["artifactType"]["schemaTitle"] for n, a in outputs.get("artifacts", {}).items()
        }
        assert kinds == (
            {"report": "system.HTML", "metrics": "system.Metrics"} if reporting else {}
        )
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
    import graphtrim.stages
    from graphtrim.kubeflow.pipeline import compile_pipeline

    _check_steps_are_stages(compiled["cpu"], STAGES)
    _check_steps_are_stages(compiled["gpu"], STAGES)
    more = (
        *STAGES[:4],
        Stage("benchmark", ("quantize",), "time one variant", per_variant=True, on_device=True),
        *STAGES[4:],
        Stage("report", ("export", "benchmark"), "summarize the run"),
    )
    monkeypatch.setattr(graphtrim.stages, "STAGES", more)
    doc = _documents(Path(compile_pipeline(tmp_path / "more.yaml", image="gt:1")))
    _check_steps_are_stages(doc, more)
    # the variants' loop runs after the search's last select (quantize judges its trials)
    deps = set(_loop(doc)["dependentTasks"])
    assert {"export", "optimize"} <= deps and all(
        d.startswith("tune-select") for d in deps - {"export", "optimize"}
    )
    report = doc["components"]["comp-report"]["inputDefinitions"]["parameters"]
    assert report["benchmarked"]["parameterType"] == "LIST"  # all variants' records


def test_config_parameters_come_from_the_run_parameter_table() -> None:
    """The run's configuration is the run-parameter table's (``graphtrim.run_params``), used
    for the pipeline's parameters and every step's command line; the module names none of them
    itself (tests/test_run_params.py checks the compiled pipeline against the table)."""
    import graphtrim.kubeflow.pipeline as module
    from graphtrim.run_params import on

    wanted = [p.name for p in on("kfp") if p.into != "source"]
    assert sorted(c.name for c in module.CONFIG) == sorted(wanted)
    read = {
        t.string.strip("\"'")
        for t in tokenize.generate_tokens(io.StringIO(Path(module.__file__).read_text()).readline)
        if t.type == tokenize.STRING
    }
    # `variants`: the loop's parameter, looked up by name; "tune": the command `graphtrim
    # pipeline tune`; everything else comes from the table
    assert read & set(wanted) <= {"variants", "tune"}


def test_gpu_pipeline_requests_gpus_for_quantize_and_gate(
    compiled: dict[str, dict[str, Any]],
) -> None:
    for device, wanted in (("gpu", True), ("cpu", False)):
        executors = compiled[device]["deploymentSpec"]["executors"]
        for name, ex in executors.items():
            accel = (ex["container"].get("resources") or {}).get("accelerator")
            on_device = name in ("exec-quantize", "exec-gate") or name.startswith("exec-tune-trial")
            if on_device and wanted:
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


def _resolve(
    arg: str, inputs: dict[str, Any], outputs: dict[str, Path], executor_input: str
) -> str:
    """What KFP's launcher does to one argument: placeholders -> values (lists as JSON)."""
    if arg.startswith('{"Concat"'):
        return "".join(
            _resolve(part, inputs, outputs, executor_input) for part in json.loads(arg)["Concat"]
        )
    if arg == "{{$}}":
        return executor_input

    def value(m: re.Match[str]) -> str:
        v = inputs[m.group(1)]
        return v if isinstance(v, str) else json.dumps(v)

    arg = re.sub(r"\{\{\$\.inputs\.parameters\['([a-z_]+)'\]\}\}", value, arg)
    for name, path in outputs.items():
        arg = arg.replace(f"{{{{$.outputs.parameters['{name}'].output_file}}}}", str(path))
    return arg.replace("{{$.pipeline_job_uuid}}", "job-1")


@dataclasses.dataclass
class Ran:
    """A step run as KFP's launcher runs it: its output parameters (``record``, its record),
    and where the launcher would pick up its output artifacts (under the object store's mount)
    and its output file."""

    outputs: dict[str, str]
    artifacts: dict[str, Path]
    output_file: Path

    @property
    def record(self) -> str:
        return self.outputs["record"]


def _run_step(doc: dict[str, Any], step: str, inputs: dict[str, Any], tmp: Path) -> Ran:
    args = doc["deploymentSpec"]["executors"][f"exec-{step}"]["container"]["args"]
    stem = f"{step}-{len(list(tmp.glob('*.json')))}"
    definitions = doc["components"][f"comp-{step}"]["outputDefinitions"]
    outputs = definitions.get("artifacts", {})
    files = {name: tmp / f"{stem}.{name}.json" for name in definitions.get("parameters", {})}
    uris = {name: f"minio://mlpipeline/v2/artifacts/job-1/{stem}/{name}" for name in outputs}
    output_file = tmp / "outputs" / stem / "executor_output.json"
    executor_input = {
        "inputs": {"parameterValues": inputs},
        "outputs": {
            "artifacts": {
                name: {
                    "artifacts": [
                        {"name": name, "type": outputs[name]["artifactType"], "uri": uris[name]}
                    ]
                }
                for name in outputs
            },
            "parameters": {name: {"outputFile": str(f)} for name, f in files.items()},
            "outputFile": str(output_file),
        },
    }
    resolved = [_resolve(a, inputs, files, json.dumps(executor_input)) for a in args]
    assert main(resolved) == 0, (step, resolved)
    return Ran(
        {name: f.read_text() for name, f in files.items()},
        {name: outputs_module.local_path(uri) for name, uri in uris.items()},
        output_file,
    )


def _kfp_run(
    digits_task: DigitsTask, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **params: Any
) -> tuple[dict[str, Any], Path, str]:
    """A run's parameters (``params`` over the defaults here), its work folder and tracking
    URI, the digits model registered as ``digits-kfp`` version 1."""
    # the object store's mount in a step's container (KFP's launcher: minio:// -> /minio/)
    monkeypatch.setattr(outputs_module, "MOUNT_ROOT", tmp_path / "mounts")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_onnx(tracking, digits_task.model, "digits-kfp", artifact_dir=tmp_path / "mlruns")
    variants = params.get("variants") or ["graph", "int8-static"]
    work = tmp_path / "outputs"
    work.mkdir()
    return (
        {
            "model_uri": "models:/digits-kfp/1",
            "tracking_uri": tracking,
            "artifacts": str(tmp_path / "artifacts"),
            "s3_endpoint_url": "",
            "variants": variants,
            "preset": "default",
            "opset": "",
            # what is checked here is the steps' wiring, not the speed of a variant on a
            # loaded machine: the latency gates time the variants without judging them
            "policy": json.dumps(
                {
                    "variants": {
                        v: {"latency": {"min_speedup": None, "runs": 20, "warmup": 3}}
                        for v in variants
                    }
                }
            ),
            "calibration": str(digits_task.calibration),
            "eval_data": str(digits_task.eval),
            "weights": "{}",  # the run's default: the weight-only defaults
            "tune": "",  # the run's default: no settings search
            "target_name": "",
            "allow_variant_source": False,  # KFP renders a boolean as false / true
            "rejudge": False,
            "force_promotion": False,
            **params,
        },
        work,
        tracking,
    )


def _search_steps(
    doc: dict[str, Any], params: dict[str, Any], records: dict[str, str], work: Path
) -> tuple[str, list[list[dict[str, Any]]]]:
    """The settings search as the compiled pipeline runs it: the plan, then per round a trial
    step per item of the round (its ParallelFor) and a select on their records (Collected).
    Returns the last select's ``search`` and each round's results."""
    plan = _run_step(doc, "tune-plan", {**params, **records}, work)
    search, batch = plan.outputs["search"], json.loads(plan.outputs["batch"])
    done = []
    for _ in range(5):  # the rounds the pipeline lays out
        results = [
            _run_step(doc, "tune-trial", {**params, **records, "trial": item}, work).record
            for item in batch  # each item a JSON string, as the ParallelFor hands it over
        ]
        done.append([json.loads(r) for r in results])
        chosen = _run_step(
            doc, "tune-select", {**params, "previous": search, "trials": results}, work
        )
        search, batch = chosen.outputs["search"], json.loads(chosen.outputs["batch"])
    assert batch == []
    return search, done


@pytest.mark.slow
def test_compiled_steps_run_the_pipeline(
    compiled: dict[str, dict[str, Any]],
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow

    doc = compiled["cpu"]
    params, work, tracking = _kfp_run(digits_task, tmp_path, monkeypatch)
    variants = params["variants"]
    exported = _run_step(doc, "export", params, work).record
    optimized = _run_step(doc, "optimize", {**params, "exported": exported}, work).record
    # no search asked: the plan and each select pass none on, every round is empty
    records = {"exported": exported, "optimized": optimized}
    search, done = _search_steps(doc, params, records, work)
    assert json.loads(search) is None and done == [[]] * 5
    gates = []
    for variant in variants:
        quantized = _run_step(
            doc,
            "quantize",
            {**params, **records, "variant": variant, "tuned": search},
            work,
        ).record
        assert list(json.loads(quantized)["variants"]) == [variant]
        gate = _run_step(
            doc, "gate", {**params, "exported": exported, "quantized": quantized}, work
        )
        gates.append(gate.record)
        # the variant's evaluation report and its gate numbers, where KFP collects them
        verdict = json.loads(gate.record)["variants"][variant]
        assert verdict["passed"], verdict
        html = gate.artifacts["report"].read_text()
        assert html.lstrip().lower().startswith("<!doctype html") and variant in html
        numbers = json.loads(gate.artifacts["metrics"].read_text())
        assert numbers[f"{variant}.passed"] == 1.0
        assert numbers[f"{variant}.speedup"] == pytest.approx(verdict["metrics"]["speedup"])
        out = json.loads(gate.output_file.read_text())
        (metrics,) = out["artifacts"]["metrics"]["artifacts"]
        assert metrics["metadata"] == numbers
        assert metrics["uri"].endswith("/metrics") and metrics["type"]["schemaTitle"] == (
            "system.Metrics"
        )
        (report,) = out["artifacts"]["report"]["artifacts"]
        assert report["uri"].endswith("/report")
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
        {**params, "exported": exported, "validated": gates, "registered": registered.record},
        work,
    ).record
    reg = json.loads(registered.record)["registered"]
    assert set(reg) == set(variants), json.loads(registered.record)
    assert json.loads(promoted)["champion"]["moved"] is True
    # the run's comparison report and the versions registered
    comparison = registered.artifacts["report"].read_text()
    assert all(v in comparison for v in variants)
    numbers = json.loads(registered.artifacts["metrics"].read_text())
    assert numbers["registered"] == 2.0 and numbers["failed"] == 0.0
    assert {numbers[f"{v}.version"] for v in variants} == {
        float(r["version"]) for r in reg.values()
    }
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
    ).record
    assert all(not r["created"] for r in json.loads(again)["registered"].values())


def test_the_search_steps_fan_out_a_step_per_trial_before_the_variants_loop(
    compiled: dict[str, dict[str, Any]],
) -> None:
    for device, doc in compiled.items():
        tasks = doc["root"]["dag"]["tasks"]
        loops = _loops(doc)
        # a ParallelFor of trial steps per round, each over the batch of the step before it
        rounds = [loop for loop in loops if loop["_name"] != _loop(doc)["_name"]]
        assert len(rounds) == 5, device
        before = "tune-plan"
        for loop in rounds:
            (step,) = _body(doc, loop).values()
            assert step["componentRef"]["name"].startswith("comp-tune-trial")
            items = loop["parameterIterator"]["items"]["inputParameter"]
            assert items == f"pipelinechannel--{before}-batch", (device, items)
            select = next(
                n
                for n, t in tasks.items()
                if n.startswith("tune-select") and loop["_name"] in t.get("dependentTasks", [])
            )
            trials = tasks[select]["inputs"]["parameters"]["trials"]
            assert trials["taskOutputParameter"]["producerTask"] == loop["_name"]  # Collected
            before = select
        # quantize judges the search the last select ended with
        quantize = _body(doc, _loop(doc))["quantize"]["inputs"]["parameters"]["tuned"]
        assert quantize["componentInputParameter"] == f"pipelinechannel--{before}-search"
        for name in ("tune-plan", before):
            assert tasks[name]["cachingOptions"] in ({}, {"enableCache": False})
        args = doc["deploymentSpec"]["executors"]["exec-tune-trial"]["container"]["args"]
        assert args[:3] == ["pipeline", "tune", "trial"]


@pytest.mark.slow
def test_the_compiled_search_steps_find_the_variant_quantize_builds(
    compiled: dict[str, dict[str, Any]],
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = compiled["cpu"]
    params, work, _ = _kfp_run(
        digits_task, tmp_path, monkeypatch, variants=["int8-dynamic"], tune="3m"
    )
    exported = _run_step(doc, "export", params, work).record
    optimized = _run_step(doc, "optimize", {**params, "exported": exported}, work).record
    records = {"exported": exported, "optimized": optimized}
    search, done = _search_steps(doc, params, records, work)
    trials = [r["trial"] for rs in done for r in rs]
    assert [r["trial"]["key"] for r in done[0]] == ["int8-dynamic"]  # the recipe first
    assert len(done[1]) > 1  # the recipe's neighbours, a step each
    assert all(t["uri"] for t in trials if t["status"] == "screened")
    quantized = json.loads(
        _run_step(
            doc,
            "quantize",
            {**params, **records, "variant": "int8-dynamic", "tuned": search},
            work,
        ).record
    )
    tuning = quantized["variants"]["int8-dynamic"]["tuning"]
    assert tuning["trials"] == len(trials) and tuning["key"].startswith("int8-dynamic")
    assert json.loads(search)["kinds"]["int8-dynamic"]["stopped"]


# ---------------------------------------------------------------------------- credentials


def _secrets(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    executors = doc["platform"].get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {})
    return {
        name: spec.get("secretAsEnv", []) for name, spec in executors.get("executors", {}).items()
    }


def test_every_step_reads_its_credentials_from_the_secret(
    compiled: dict[str, dict[str, Any]],
) -> None:
    """Each step's pod gets MLflow's and S3's credentials from one Kubernetes Secret, each key
    optional (a Secret holds what its deployment needs; without it, the pod's identity)."""
    from graphtrim.kubeflow.pipeline import CREDENTIALS, DEFAULT_SECRET

    for doc in compiled.values():
        secrets = _secrets(doc)
        assert set(secrets) == set(doc["deploymentSpec"]["executors"])
        for name, uses in secrets.items():
            (use,) = uses
            assert use["secretName"] == DEFAULT_SECRET, name
            assert use["optional"] is True, name
            assert {(k["secretKey"], k["envVar"]) for k in use["keyToEnv"]} == {
                (k, k) for k in CREDENTIALS
            }
        # no credential is ever a value written into the pipeline itself
        for ex in doc["deploymentSpec"]["executors"].values():
            assert not {e["name"] for e in ex["container"].get("env", [])} & set(CREDENTIALS)


def test_the_secret_is_named_at_compile_time_or_left_out(tmp_path: Path) -> None:
    named = tmp_path / "named.yaml"
    assert main(["kfp", "compile", "-o", str(named), "--credentials-secret", "mlops-creds"]) == 0
    assert {u["secretName"] for uses in _secrets(_documents(named)).values() for u in uses} == {
        "mlops-creds"
    }
    none = tmp_path / "none.yaml"
    assert main(["kfp", "compile", "-o", str(none), "--credentials-secret", ""]) == 0
    assert not any(_secrets(_documents(none)).values())


# ---------------------------------------------------------------------------- KFP outputs


def test_metrics_of_a_gate_and_a_register_record() -> None:
    gate = {
        "variants": {
            "int8-static": {
                "passed": True,
                "metrics": {"speedup": 2.5, "cosine": 0.999, "note": "text", "nan": float("nan")},
            },
            "fp16": {"passed": False, "metrics": {"speedup": 0.8, "flag": True}},
        }
    }
    assert outputs_module.metrics_of(gate) == {
        "fp16.passed": 0.0,
        "fp16.speedup": 0.8,
        "int8-static.passed": 1.0,
        "int8-static.cosine": 0.999,
        "int8-static.speedup": 2.5,
    }
    register = {"registered": {"graph": {"version": "7"}}, "failed": {"fp16": ["latency"]}}
    assert outputs_module.metrics_of(register) == {
        "registered": 1.0,
        "failed": 1.0,
        "graph.version": 7.0,
    }


def test_local_paths_are_the_launchers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(outputs_module, "MOUNT_ROOT", tmp_path)
    assert outputs_module.local_path("s3://b/k/report") == tmp_path / "s3/b/k/report"
    assert outputs_module.local_path("gs://b/k") == tmp_path / "gcs/b/k"
    assert outputs_module.local_path("minio://mlpipeline/x") == tmp_path / "minio/mlpipeline/x"
    # kfp.local hands a step its artifacts' local paths
    assert outputs_module.local_path("/runs/p-1/gate/report") == Path("/runs/p-1/gate/report")
    with pytest.raises(GraphtrimError, match="not on an object store"):
        outputs_module.local_path("https://example.com/x")


def test_a_step_without_a_report_writes_its_metrics_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A registration run that judged nothing new has no comparison report: the metrics are
    still written, the report artifact left alone, nothing fails."""
    monkeypatch.setattr(outputs_module, "MOUNT_ROOT", tmp_path / "mnt")
    executor_input = {
        "outputs": {
            "artifacts": {
                n: {"artifacts": [{"name": n, "uri": f"s3://b/run/{n}"}]}
                for n in ("report", "metrics")
            },
            "outputFile": str(tmp_path / "out" / "executor_output.json"),
        }
    }
    written = outputs_module.write_outputs(
        {"registered": {"graph": {"version": "3"}}, "failed": {}, "reports": None},
        executor_input,
    )
    assert set(written) == {"metrics"}
    assert not (tmp_path / "mnt" / "s3" / "b" / "run" / "report").exists()
    out = json.loads((tmp_path / "out" / "executor_output.json").read_text())
    assert set(out["artifacts"]) == {"metrics"}
    assert out["artifacts"]["metrics"]["artifacts"][0]["metadata"]["graph.version"] == 3.0


def test_a_step_with_a_bad_executor_input_exits_2_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["kfp", "step", "--executor-input", "{not json", "export", "--output", str(tmp_path / "r")]
    )
    assert code == 2
    assert "executor input" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
