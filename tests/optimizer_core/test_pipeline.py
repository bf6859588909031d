"""The pipeline stages against a real MLflow tracking server (SQLite) and a real S3 endpoint
(moto's server), plus the embedded mode (SQLite tracking URI, local artifacts)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.examples.digits import DigitsTask
from graphtrim.exporter import ExportError
from graphtrim.integrations.artifacts import ArtifactStoreError
from graphtrim.integrations.registry import (
    Registry,
    RegistryError,
    logged_model_id,
    parse_gates,
)
from graphtrim.stages import pipeline
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.export import variant_identity
from tests.conftest import BUCKET
from tests.servers import free_port, register_onnx

pytestmark = [pytest.mark.slow]

mlflow = pytest.importorskip("mlflow")
boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def digits(digits_task: DigitsTask) -> DigitsTask:
    return digits_task


def _ctx(servers: dict[str, str], tmp_path: Path, **kw: Any) -> StageContext:
    return StageContext(
        servers["mlflow"],
        f"s3://{BUCKET}/pipeline",
        workdir=str(tmp_path / "work"),
        s3_endpoint_url=servers["s3"],
        **kw,
    )


# These tests are about the registry and the store, not about timing: under a parallel test
# run a variant that computes the same thing can time anywhere near 1x, so the latency gates
# are measured (the numbers reach the lineage) but their bar is set far from the noise (one
# block of a graph variant measured below 0.5x on a machine loaded by the whole suite). The bar
# is there at all so the version's description shows the speedup beside its limit.
RELAXED = {
    "variants": {
        v: {"latency": {"min_speedup": 0.05, "runs": 60, "warmup": 10}}
        for v in ("graph", "int8-static", "fp16")
    }
}


def _policy(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(RELAXED))
    for key, value in (extra or {}).items():
        if key == "variants":
            for variant, entry in value.items():
                doc["variants"].setdefault(variant, {}).update(entry)
        else:
            doc[key] = value
    return doc


def _policy_file(tmp_path: Path) -> str:
    import yaml

    path = tmp_path / "gates.yaml"
    path.write_text(yaml.safe_dump(_policy()))
    return str(path)


def _config(digits: DigitsTask, **kw: Any) -> PipelineConfig:
    kw["policy"] = _policy(kw.get("policy"))
    return PipelineConfig(calibration=str(digits.calibration), eval_data=str(digits.eval), **kw)


def _versions(tracking: str, name: str) -> list[Any]:
    from mlflow import MlflowClient

    return list(MlflowClient(tracking, tracking).search_model_versions(f"name='{name}'"))


def _predict(model: Any, x: np.ndarray) -> np.ndarray:
    out = model.predict({"image": x})
    if isinstance(out, dict):
        return np.asarray(next(iter(out.values())))
    return np.asarray(out)


# ---------------------------------------------------------------------------- onnx flavor


@pytest.fixture(scope="module")
def digits_run(
    servers: dict[str, str], digits: DigitsTask, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    register_onnx(servers["mlflow"], digits.model, "digits")
    reg = Registry(servers["mlflow"])
    reg.client.set_registered_model_alias("digits", "champion", "1")
    tmp = tmp_path_factory.mktemp("digits-run")
    policy = {"promotion": {"metric": "bytes", "margin": 0.5}}
    config = _config(digits, policy=policy)
    t0 = time.perf_counter()
    records = pipeline.run_pipeline(_ctx(servers, tmp), config, "models:/digits/1")
    records["_seconds"] = time.perf_counter() - t0
    records["_config"] = config
    return records


def test_run_registers_passing_variants_with_lineage(
    servers: dict[str, str], digits_run: dict[str, Any]
) -> None:
    reg = digits_run["register"]["registered"]
    validated = digits_run["validate"]["variants"]
    assert "int8-static" in reg and "graph" in reg, validated
    # every passing variant is registered, no failed one is
    assert set(reg) == {v for v, s in validated.items() if s["passed"]}
    for variant, summary in validated.items():
        if not summary["passed"]:
            assert variant in digits_run["register"]["failed"]
    # every built variant's record says how closely it agrees with the float model
    for variant, built in digits_run["quantize"]["variants"].items():
        agreement = built["agreement"]
        assert agreement["measured"] is True and agreement["cosine"] > 0.9, (variant, agreement)
    config = PipelineConfig.from_json(digits_run["export"]["config"])
    # the data files' content enters the hash
    assert set(config.data_sha256 or {}) == {"calibration", "eval_data"}
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    for variant, rec in reg.items():
        found = client.search_model_versions(
            "name='digits' and tags.`graphtrim.source.name`='digits' and "
            f"tags.`graphtrim.source.version`='1' and tags.`graphtrim.variant`='{variant}'"
        )
        assert [str(v.version) for v in found] == [rec["version"]]
        mv = found[0]
        tags = mv.tags
        assert tags["graphtrim.config_hash"] == config.config_hash
        assert tags["graphtrim.preset"] == "default"
        assert tags["graphtrim.source.run_id"] == digits_run["export"]["source"]["run_id"]
        assert tags["graphtrim.source.model_id"].startswith("m-")
        assert tags["graphtrim.pipeline_run_id"] == digits_run["export"]["run_id"]
        # verdicts in one short tag that a search can match
        assert tags["graphtrim.gates"] == "serving=pass,size=pass,accuracy=pass,latency=pass"
        assert len(tags["graphtrim.fingerprint"]) == 16
        assert tags["graphtrim.artifact"].startswith(f"s3://{BUCKET}/pipeline/digits/1/variant-")
        # short and queryable: no JSON documents, nothing long, but for two records: the alias
        # moves' audit (graphtrim.audit.<alias>, the promote stage's) and each policy's verdict
        # (graphtrim.verdict.<policy hash>, read back so a re-run reuses a measured verdict)
        records = ("graphtrim.audit.", "graphtrim.verdict.")
        long = {
            k: v
            for k, v in tags.items()
            if len(v) > 80 and k != "graphtrim.artifact" and not k.startswith(records)
        }
        assert not long, long
        assert not [
            k
            for k, v in tags.items()
            if v.lstrip().startswith(("{", "[")) and not k.startswith(records)
        ]
        verdicts = [json.loads(v) for k, v in tags.items() if k.startswith("graphtrim.verdict.")]
        assert len(verdicts) == 1, verdicts
        assert verdicts[0]["passed"] is True, verdicts
        gates = dict(g.split("=") for g in tags["graphtrim.gates"].split(","))
        assert verdicts[0]["gates"] == gates, (verdicts, gates)
        # the logged model is linked to the version and holds the settings and numbers
        logged = client.get_logged_model(logged_model_id(mv))
        links = json.loads(logged.tags["mlflow.modelVersions"])
        assert [(d["name"], str(d["version"])) for d in links] == [("digits", rec["version"])]
        assert logged.params["variant"] == variant
        assert logged.params["preset"] == "default"
        assert "dead-code" in logged.params["passes"].split(",")
        assert logged.params["version.onnxruntime"] == ort.__version__
        assert logged.params["config_hash"] == config.config_hash
        metrics = {m.key: m.value for m in logged.metrics}
        numbers = digits_run["validate"]["variants"][variant]["metrics"]
        assert metrics[f"{variant}.bytes"] == numbers["bytes"] > 0
        assert metrics[f"{variant}.speedup"] == pytest.approx(numbers["speedup"])
        assert metrics[f"{variant}.cosine"] == pytest.approx(numbers["cosine"])
        # promotion and re-runs read the numbers back from the logged model
        lineage = Registry(servers["mlflow"]).lineage(mv)
        assert lineage["metrics"]["bytes"] == numbers["bytes"]
        assert lineage["gates"]["latency"] == "pass"
        # the description says what the version is, with each gate's numbers and the report
        text = mv.description
        assert f"**{variant}** variant of `digits` version 1" in text
        assert "| accuracy | PASS | " in text and "(limit >= " in text
        assert "p50 speedup" in text
        assert digits_run["register"]["reports"]["html"] in text
        assert logged.tags["mlflow.note.content"] == text


def test_the_mlflow_copy_is_the_stored_bytes(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path
) -> None:
    """The files MLflow serves for a registered variant hash to its graphtrim.sha256 tag."""
    from graphtrim.integrations.model_files import model_files, sha256_files

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    for variant, rec in digits_run["register"]["registered"].items():
        mv = client.get_model_version("digits", rec["version"])
        got = Path(
            mlflow.artifacts.download_artifacts(
                f"models:/digits/{rec['version']}",
                dst_path=str(tmp_path / variant),
                tracking_uri=servers["mlflow"],
            )
        )
        files = model_files(got / "model.onnx")
        assert sha256_files(files) == mv.tags["graphtrim.sha256"], variant


def test_the_run_has_one_comparison_report_of_every_variant(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path
) -> None:
    import html

    reports = digits_run["register"]["reports"]
    assert set(reports) == {"json", "markdown", "html"}
    s3 = boto3.client("s3", endpoint_url=servers["s3"])
    key = reports["html"].removeprefix(f"s3://{BUCKET}/")
    page = html.unescape(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode())
    validated = digits_run["validate"]["variants"]
    for variant in validated:
        assert f'<h3 id="variant-{variant}">' in page
    assert "models:/digits/1" in page and "Speed against accuracy" in page
    assert "<h2>Builds</h2>" in page  # the build records, from the run's build-<variant>.json
    # each gate task's own evaluation names the reference as the registry does too
    evaluation = digits_run["validate"]["reports"]["json"].removeprefix(f"s3://{BUCKET}/")
    doc = json.loads(s3.get_object(Bucket=BUCKET, Key=evaluation)["Body"].read())
    assert doc["reference"]["path"] == "models:/digits/1"
    run_id = digits_run["export"]["run_id"]
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    names = {f.path for f in client.list_artifacts(run_id, "graphtrim/reports")}
    assert "graphtrim/reports/comparison.html" in names


def test_registered_variants_load_with_pyfunc_and_match_the_source(
    servers: dict[str, str], digits: DigitsTask, digits_run: dict[str, Any], tmp_path: Path
) -> None:
    mlflow.set_tracking_uri(servers["mlflow"])
    data = np.load(digits.eval)
    x = data["image"][:64].astype(np.float32)
    labels = data["labels"][:64]

    def load(version: str) -> Any:  # downloaded here, not into a folder MLflow never removes
        dest = tmp_path / version
        dest.mkdir()
        return mlflow.pyfunc.load_model(f"models:/digits/{version}", dst_path=str(dest))

    source = _predict(load("1"), x)
    reg = digits_run["register"]["registered"]
    graph = _predict(load(reg["graph"]["version"]), x)
    np.testing.assert_allclose(graph, source, rtol=1e-4, atol=1e-5)
    static = _predict(load(reg["int8-static"]["version"]), x)
    # the int8 gate's own criteria: top-1 agreement and accuracy within the policy's drop
    assert np.mean(static.argmax(1) == source.argmax(1)) >= 0.95
    assert np.mean(static.argmax(1) == labels) >= np.mean(source.argmax(1) == labels) - 0.05


def test_artifacts_are_content_addressed_in_s3(
    servers: dict[str, str], digits_run: dict[str, Any]
) -> None:
    s3 = boto3.client("s3", endpoint_url=servers["s3"])
    keys = {
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="pipeline/")
        for o in page.get("Contents", [])
    }
    for stage in ("export", "optimize"):
        sha = digits_run[stage]["model"]["sha256"]
        assert f"pipeline/digits/1/{stage}/{sha}/model.onnx" in keys
        assert f"pipeline/digits/1/{stage}/{sha}/manifest.json" in keys
    manifest = json.loads(
        s3.get_object(
            Bucket=BUCKET,
            Key=f"pipeline/digits/1/optimize/{digits_run['optimize']['model']['sha256']}/manifest.json",
        )["Body"].read()
    )
    assert manifest["parents"] == [digits_run["export"]["model"]["sha256"]]
    assert manifest["config_hash"]
    assert any(k.endswith("/evaluation.html") for k in keys)


def test_pipeline_run_in_mlflow_holds_params_metrics_and_reports(
    servers: dict[str, str], digits_run: dict[str, Any]
) -> None:
    client = mlflow.MlflowClient(servers["mlflow"])
    run = client.get_run(digits_run["export"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["variants"] == "graph,int8-dynamic,int8-static"
    assert run.data.params["exporter"] == "none"
    m = run.data.metrics
    assert m["nodes_after"] <= m["nodes_before"]
    assert "int8-static.speedup" in m and "int8-static.max_abs_error" in m
    # where each stage ran
    for stage in ("export", "optimize", "quantize", "validate", "register", "promote"):
        where = json.loads(run.data.tags[f"graphtrim.worker.{stage}"])
        assert where["host"] and where["pid"] > 0
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "graphtrim/reports")}
    assert {"graphtrim/reports/evaluation.html", "graphtrim/reports/evaluation.json"} <= arts
    failed = [v for v, s in digits_run["validate"]["variants"].items() if not s["passed"]]
    for variant in failed:
        assert f"graphtrim.failed.{variant}" in run.data.tags


def test_rerun_registers_nothing_new(
    servers: dict[str, str], digits: DigitsTask, digits_run: dict[str, Any], tmp_path: Path
) -> None:
    before = len(_versions(servers["mlflow"], "digits"))
    again = pipeline.run_pipeline(
        _ctx(servers, tmp_path), digits_run["_config"], "models:/digits/1"
    )
    assert len(_versions(servers["mlflow"], "digits")) == before
    first = digits_run["register"]["registered"]
    for variant, rec in again["register"]["registered"].items():
        assert rec["created"] is False
        assert rec["version"] == first[variant]["version"]
    # nothing was exported, built or timed again: the recorded verdicts are reported
    assert again["export"]["model"] is None and again["optimize"]["model"] is None
    assert again["quantize"]["variants"] == {}
    for variant, summary in again["validate"]["variants"].items():
        assert summary["reused"] is True
        assert summary["passed"] == digits_run["validate"]["variants"][variant]["passed"]
    assert set(again["register"]["failed"]) == set(digits_run["register"]["failed"])
    assert again["promote"]["champion"]["moved"] is False
    # --rejudge measures again, and still registers nothing new
    rejudged = pipeline.run_pipeline(
        _ctx(servers, tmp_path, rejudge=True), digits_run["_config"], "models:/digits/1"
    )
    assert rejudged["optimize"]["model"]["sha256"] == digits_run["optimize"]["model"]["sha256"]
    assert not any(s.get("reused") for s in rejudged["validate"]["variants"].values())
    assert len(_versions(servers["mlflow"], "digits")) == before


def test_promotion_candidate_aliases_and_champion_by_margin(
    servers: dict[str, str], digits_run: dict[str, Any]
) -> None:
    reg = Registry(servers["mlflow"])
    registered = digits_run["register"]["registered"]
    for variant, rec in registered.items():
        assert reg.alias_version("digits", f"{variant}-candidate") == rec["version"]
    champion = digits_run["promote"]["champion"]
    # bytes, margin 0.5: int8-static is ~0.28x the source's size; the graph variant is not
    assert champion["moved"] is True, champion
    assert champion["variant"] == "int8-static"
    assert reg.alias_version("digits", "champion") == registered["int8-static"]["version"]
    audit = json.loads(reg.version_tags("digits", "1")["graphtrim.audit.champion"])[-1]
    assert audit["from"] == "1" and audit["to"] == registered["int8-static"]["version"]
    assert audit["who"] and audit["when"] and "pipeline run" in audit["why"]


def test_rollback_moves_champion_back_with_audit(
    servers: dict[str, str], digits_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    reg = Registry(servers["mlflow"])
    current = reg.alias_version("digits", "champion")
    assert current != "1"
    code = main(
        [
            "rollback",
            "digits",
            "--alias",
            "champion",
            "--why",
            "latency regression in canary",
            "--tracking-uri",
            servers["mlflow"],
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert reg.alias_version("digits", "champion") == "1"
    for version in ("1", current):
        audit = json.loads(reg.version_tags("digits", str(version))["graphtrim.audit.champion"])[-1]
        assert audit["action"] == "rollback"
        assert audit["why"] == "latency regression in canary"
    # nothing earlier on record: a second rollback is a clear error, alias unchanged
    again = ["rollback", "digits", "--alias", "champion", "--why", "x"]
    assert main([*again, "--tracking-uri", servers["mlflow"]]) == 2
    assert "no earlier version" in capsys.readouterr().err
    assert reg.alias_version("digits", "champion") == "1"


def test_champion_stays_when_not_better_by_the_margin(
    servers: dict[str, str], digits: DigitsTask, digits_run: dict[str, Any], tmp_path: Path
) -> None:
    reg = Registry(servers["mlflow"])
    # the champion on version 1, as the rollback test leaves it when it ran just before: whatever
    # else ran first on these servers, the version built here is then new content, and the
    # margin alone decides
    reg.move_alias("digits", "champion", "1", why="test precondition")
    holder = reg.alias_version("digits", "champion")
    # a config with a huge margin: another config hash, so new versions are registered
    policy = {"promotion": {"metric": "bytes", "margin": 0.9}}
    # forced: the rollback before holds the champion; the margin alone must keep it
    records = pipeline.run_pipeline(
        _ctx(servers, tmp_path, force_promotion=True),
        _config(digits, policy=policy, variants=("int8-static",)),
        "models:/digits/1",
    )
    champion = records["promote"]["champion"]
    assert champion["moved"] is False
    assert "not better by the margin" in champion["reason"]
    assert reg.alias_version("digits", "champion") == holder


def test_candidate_failing_gates_leaves_champion_untouched(
    servers: dict[str, str], digits: DigitsTask, digits_run: dict[str, Any], tmp_path: Path
) -> None:
    reg = Registry(servers["mlflow"])
    holder = reg.alias_version("digits", "champion")
    before = len(_versions(servers["mlflow"], "digits"))
    impossible = {"size": {"max_ratio": 0.01}}  # nothing can pass
    policy = {"variants": {"graph": impossible, "int8-static": impossible}}
    records = pipeline.run_pipeline(
        _ctx(servers, tmp_path),
        _config(digits, policy=policy, variants=("graph", "int8-static")),
        "models:/digits/1",
    )
    assert records["register"]["registered"] == {}
    assert set(records["register"]["failed"]) == {"graph", "int8-static"}
    assert records["promote"]["champion"]["moved"] is False
    assert "passed its gates" in records["promote"]["champion"]["reason"]
    assert reg.alias_version("digits", "champion") == holder
    assert len(_versions(servers["mlflow"], "digits")) == before


def test_manual_promote_refuses_a_version_that_failed_gates(
    servers: dict[str, str], digits_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    reg = Registry(servers["mlflow"])
    version = digits_run["register"]["registered"]["graph"]["version"]
    uri = f"models:/digits/{version}"
    base = ["--tracking-uri", servers["mlflow"], "--alias", "staging", "--why", "manual test"]
    reg.client.set_model_version_tag(
        "digits", version, "graphtrim.gates", json.dumps({"latency": "undecided"})
    )
    try:
        assert main(["promote", uri, *base]) == 2
        assert "did not pass its gates" in capsys.readouterr().err
        assert reg.alias_version("digits", "staging") is None
        assert main(["promote", uri, *base, "--force"]) == 0
        assert reg.alias_version("digits", "staging") == version
    finally:
        reg.client.set_model_version_tag(
            "digits", version, "graphtrim.gates", json.dumps({"size": "pass"})
        )


# ---------------------------------------------------------------------------- idempotency


def test_fault_between_log_and_register_ends_with_one_version_per_variant(
    servers: dict[str, str],
    digits: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register_onnx(servers["mlflow"], digits.model, "digits-fault")
    config = _config(digits, variants=("graph", "int8-static"))
    calls = {"n": 0}
    real = Registry.register

    def crash_once(self: Registry, *args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RegistryError("injected: registry unavailable after logging")
        return real(self, *args, **kw)

    monkeypatch.setattr(Registry, "register", crash_once)
    ctx = _ctx(servers, tmp_path, orchestrator_run_id="manual__fault-1")
    with pytest.raises(RegistryError, match="injected"):
        pipeline.run_pipeline(ctx, config, "models:/digits-fault/1")
    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    assert [v.version for v in _versions(servers["mlflow"], "digits-fault")] == ["1"]
    runs = client.search_runs(
        [client.get_experiment_by_name("graphtrim").experiment_id],
        "tags.`graphtrim.orchestrator_run_id` = 'manual__fault-1'",
    )
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    assert runs[0].data.tags["graphtrim.failed_stage"] == "register"

    # the retry (same orchestrator run id) logs into the same run and registers each once
    records = pipeline.run_pipeline(ctx, config, "models:/digits-fault/1")
    assert records["export"]["run_id"] == runs[0].info.run_id
    versions = _versions(servers["mlflow"], "digits-fault")
    by_variant: dict[str, int] = {}
    for v in versions:
        if "graphtrim.variant" in v.tags:
            by_variant[v.tags["graphtrim.variant"]] = (
                by_variant.get(v.tags["graphtrim.variant"], 0) + 1
            )
    assert by_variant == {v: 1 for v in records["register"]["registered"]}
    assert "graph" in by_variant
    # the model logged before the crash was reused, not logged twice
    exp = client.get_experiment_by_name("graphtrim").experiment_id
    key = variant_identity(config.resolved(ctx), records["export"]["source"], "graph")
    logged = mlflow.search_logged_models(
        experiment_ids=[exp], filter_string=f"tags.`graphtrim.key` = '{key}'", output_format="list"
    )
    assert len(logged) == 1


# ---------------------------------------------------------------------------- pytorch flavor


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ).eval()


@pytest.mark.parametrize("fmt", ["pt2", "pickle"])
def test_pytorch_flavor_exports_with_dynamic_batch_and_registers(
    servers: dict[str, str], tmp_path: Path, fmt: str
) -> None:
    import torch

    model = _mlp()
    example = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    name = f"mlp-{fmt}"
    mlflow.set_tracking_uri(servers["mlflow"])
    with mlflow.start_run():
        mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=example,
            serialization_format=fmt,
            registered_model_name=name,
            pip_requirements=[],
        )
    records = pipeline.run_pipeline(
        _ctx(servers, tmp_path),
        PipelineConfig(variants=("graph",), policy=_policy()),
        f"models:/{name}/1",
    )
    export = records["export"]["export"]
    assert export["flavor"] == ("pytorch-pt2" if fmt == "pt2" else "pytorch-pickle")
    assert export["exporter"] in ("dynamo", "torchscript")
    if fmt == "pickle":
        assert any("pickled" in n for n in export["notes"])
    version = records["register"]["registered"]["graph"]["version"]
    # dynamic batch: the registered ONNX model takes any batch size and matches torch
    served = tmp_path / "served"
    served.mkdir()
    loaded = mlflow.pyfunc.load_model(f"models:/{name}/{version}", dst_path=str(served))
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    inputs = loaded.metadata.get_input_schema().input_names()
    out = loaded.predict({inputs[0]: x})
    got = np.asarray(next(iter(out.values())) if isinstance(out, dict) else out)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    tags = Registry(servers["mlflow"]).version_tags(name, version)
    assert tags["graphtrim.source.version"] == "1"


def test_pytorch_model_without_signature_or_example_is_refused(
    servers: dict[str, str], tmp_path: Path
) -> None:
    mlflow.set_tracking_uri(servers["mlflow"])
    with mlflow.start_run():
        mlflow.pytorch.log_model(
            _mlp(),
            name="model",
            serialization_format="pickle",
            registered_model_name="mlp-nosig",
            pip_requirements=[],
        )
    with pytest.raises(ExportError, match="neither a tensor signature nor an input example"):
        pipeline.run_pipeline(
            _ctx(servers, tmp_path), PipelineConfig(variants=("graph",)), "models:/mlp-nosig/1"
        )
    assert [v.version for v in _versions(servers["mlflow"], "mlp-nosig")] == ["1"]


def test_pytorch_model_with_a_column_signature_is_refused(
    servers: dict[str, str], tmp_path: Path
) -> None:
    import pandas as pd
    from mlflow.models import infer_signature

    frame = pd.DataFrame({f"f{i}": np.zeros(2, np.float32) for i in range(8)})
    mlflow.set_tracking_uri(servers["mlflow"])
    with mlflow.start_run():
        mlflow.pytorch.log_model(
            _mlp(),
            name="model",
            serialization_format="pickle",
            signature=infer_signature(frame),
            registered_model_name="mlp-columns",
            pip_requirements=[],
        )
    with pytest.raises(ExportError, match=r"is a column .* not a tensor"):
        pipeline.run_pipeline(
            _ctx(servers, tmp_path), PipelineConfig(variants=("graph",)), "models:/mlp-columns/1"
        )
    assert [v.version for v in _versions(servers["mlflow"], "mlp-columns")] == ["1"]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("models:/no-such-model/1", "registered model 'no-such-model'"),
        ("models:/digits/999", "version 999 of registered model 'digits'"),
        ("models:/digits@no-such-alias", "alias 'no-such-alias'"),
        ("runs:/abc/model", "not a registry model URI"),
    ],
)
def test_missing_model_version_or_alias_is_a_clear_error(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path, uri: str, match: str
) -> None:
    before = len(_versions(servers["mlflow"], "digits"))
    with pytest.raises(RegistryError, match=match):
        pipeline.run_pipeline(_ctx(servers, tmp_path), PipelineConfig(variants=("graph",)), uri)
    assert len(_versions(servers["mlflow"], "digits")) == before


def test_unreachable_mlflow_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import urllib3.connection

    port = free_port()
    ctx = StageContext(f"http://127.0.0.1:{port}", str(tmp_path / "art"))
    # every connection attempt to the dead server: failing fast is one attempt, not minutes of
    # client retries (counted, not timed: the time depends on the machine's load)
    attempts: list[int] = []
    connect = urllib3.connection.HTTPConnection.connect

    def counted(self: Any) -> None:
        if self.port == port:
            attempts.append(port)
        connect(self)

    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", counted)
    with pytest.raises(RegistryError, match="cannot reach the MLflow tracking server"):
        pipeline.run_pipeline(ctx, PipelineConfig(variants=("graph",)), "models:/digits/1")
    assert len(attempts) == 1, attempts
    assert not (tmp_path / "art").exists()


def test_s3_down_is_a_clear_error_and_registers_nothing(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path
) -> None:
    before = len(_versions(servers["mlflow"], "digits"))
    dead = f"http://127.0.0.1:{free_port()}"
    ctx = StageContext(
        servers["mlflow"], f"s3://{BUCKET}/x", workdir=str(tmp_path), s3_endpoint_url=dead
    )
    with pytest.raises(ArtifactStoreError, match=dead.replace(".", r"\.")):
        pipeline.run_pipeline(ctx, PipelineConfig(variants=("graph",)), "models:/digits/1")
    assert len(_versions(servers["mlflow"], "digits")) == before
    missing = StageContext(
        servers["mlflow"], "s3://no-such-bucket/x", s3_endpoint_url=servers["s3"]
    )
    with pytest.raises(ArtifactStoreError, match="NoSuchBucket"):
        pipeline.run_pipeline(missing, PipelineConfig(variants=("graph",)), "models:/digits/1")


def test_bad_config_is_refused_before_any_work() -> None:
    from graphtrim.stages.context import PipelineError

    with pytest.raises(PipelineError, match="unknown variant"):
        PipelineConfig(variants=("int3",))
    with pytest.raises(PipelineError, match="unknown preset"):
        PipelineConfig(preset="turbo")
    with pytest.raises(Exception, match="unknown top-level"):
        PipelineConfig(policy={"gates": {}})


# ---------------------------------------------------------------------------- embedded + CLI


def test_embedded_mode_cli_run_and_rerun(
    digits: DigitsTask, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_onnx(tracking, digits.model, "digits-local", artifact_dir=tmp_path / "mlruns")
    args = [
        "pipeline",
        "run",
        "--model",
        "models:/digits-local/1",
        "--tracking-uri",
        tracking,
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--variants",
        "graph,int8-static",
        "--calibration",
        str(digits.calibration),
        "--eval-data",
        str(digits.eval),
        "--json",
        str(tmp_path / "records.json"),
        "--policy",
        _policy_file(tmp_path),
        "-q",
    ]
    # not quiet, its stderr a log file's (not a terminal): a line per stage, started and done,
    # and none per optimizer pass
    assert main([a for a in args if a != "-q"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "int8-static" in out and "PASS" in out and "champion" in out
    lines = [x.split("] ", 1)[-1] for x in captured.err.splitlines() if x.startswith("[graphtrim")]
    assert "stage 1/6 export" in lines and "stage 6/6 promote" in lines, lines
    assert any(x.startswith("stage 2/6 optimize done in ") for x in lines), lines
    assert not [x for x in lines if x.startswith("iteration ")], lines
    records = json.loads((tmp_path / "records.json").read_text())
    versions = {v: r["version"] for v, r in records["register"]["registered"].items()}
    assert set(versions) == {"graph", "int8-static"}
    assert (tmp_path / "artifacts" / "digits-local" / "1" / "export").is_dir()
    # the unset champion went to the best variant
    assert records["promote"]["champion"]["moved"] is True
    assert main(args) == 0
    assert "(existing)" in capsys.readouterr().out
    again = json.loads((tmp_path / "records.json").read_text())
    assert {v: r["version"] for v, r in again["register"]["registered"].items()} == versions
    assert len(_versions(tracking, "digits-local")) == 3


def test_stage_by_stage_cli_equals_one_run(
    digits: DigitsTask, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What an orchestrator does: one process per stage, records passed as JSON files."""
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    register_onnx(tracking, digits.model, "digits-staged", artifact_dir=tmp_path / "mlruns")
    common = [
        "--tracking-uri",
        tracking,
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--variants",
        "graph",
        "--eval-data",
        str(digits.eval),
        "--policy",
        _policy_file(tmp_path),
        "-q",
    ]
    rec = tmp_path / "records"
    needs = {
        "export": [],
        "optimize": ["export"],
        "quantize": ["export", "optimize"],
        "validate": ["export", "quantize"],
        "register": ["optimize", "validate"],
        "promote": ["validate", "register"],
    }
    for stage, inputs in needs.items():
        extra = ["--model", "models:/digits-staged/1"] if stage == "export" else []
        for name in inputs:
            extra += ["--input", f"{name}={rec / (name + '.json')}"]
        code = main(
            ["pipeline", "stage", stage, *extra, "--output", str(rec / f"{stage}.json"), *common]
        )
        assert code == 0, (stage, capsys.readouterr().err)
    registered = json.loads((rec / "register.json").read_text())["registered"]
    assert registered["graph"]["created"] is True
    # the same pipeline in one process finds that version: the config hashes agree
    assert main(["pipeline", "run", "--model", "models:/digits-staged/1", *common]) == 0
    assert "(existing)" in capsys.readouterr().out
    assert len(_versions(tracking, "digits-staged")) == 2
    # a stage without the records it needs is a clear error
    assert (
        main(["pipeline", "stage", "register", "--output", str(tmp_path / "x.json"), *common]) == 2
    )
    assert "needs --input" in capsys.readouterr().err


def test_cli_missing_model_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(
        [
            "pipeline",
            "run",
            "--model",
            "models:/nothing/1",
            "--tracking-uri",
            tracking,
            "--artifacts",
            str(tmp_path / "a"),
            "-q",
        ]
    )
    assert code == 2
    assert "registered model 'nothing'" in capsys.readouterr().err


def test_export_in_a_fresh_process_uses_only_the_given_registry(
    servers: dict[str, str], digits: DigitsTask, tmp_path: Path
) -> None:
    """A worker process has no MLflow URI of its own: the stage must not fall back to MLflow's
    process defaults (a ./mlflow.db in its working directory)."""
    import subprocess
    import sys

    version = register_onnx(servers["mlflow"], digits.model, "digits-fresh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    cwd = tmp_path / "worker"
    cwd.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphtrim.cli",
            "pipeline",
            "stage",
            "export",
            "--model",
            f"models:/digits-fresh/{version}",
            "--tracking-uri",
            servers["mlflow"],
            "--artifacts",
            str(tmp_path / "artifacts"),
            "--variants",
            "graph",
            "--output",
            str(tmp_path / "export.json"),
            "-q",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "export.json").read_text())["source"]["version"] == version
    assert list(cwd.iterdir()) == []


# ---------------------------------------------------------------------------- in a browser


def test_a_registered_variant_in_mlflows_ui(
    servers: dict[str, str], digits_run: dict[str, Any]
) -> None:
    """MLflow's own UI in a real browser: the version page renders the description (gates
    with their numbers), the logged model it links to lists its metrics, params and version."""
    from tests.browser import open_page, parse

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    version = digits_run["register"]["registered"]["int8-static"]["version"]
    mv = client.get_model_version("digits", version)
    model_id = logged_model_id(mv)
    assert model_id is not None
    experiment = client.get_logged_model(model_id).experiment_id
    base = servers["mlflow"]

    text, tags = parse(open_page(f"{base}/#/models/digits/versions/{version}", "mlflow-version"))
    assert f"Version {version}" in text
    assert "graphtrim int8-static variant of digits version 1" in text
    assert "measured (limit)" in text and "(limit >= " in text  # the gate table, rendered
    assert any(t == "table" for t, _ in tags)
    assert any(t == "strong" for t, _ in tags)  # Markdown, not its source
    assert "**int8-static**" not in text
    links = [a.get("href") or "" for t, a in tags if t == "a"]
    assert any(model_id in h for h in links), links  # "Source model": the logged model
    # the description links the comparison report's page in MLflow's artifact view
    (report,) = [h for h in links if h.endswith("/artifacts/graphtrim/reports/comparison.html")]
    assert report.startswith(f"{base}/#/experiments/{experiment}/runs/")
    text, tags = parse(open_page(report, "mlflow-comparison-artifact"))
    assert "comparison.html" in text
    assert any(t == "iframe" for t, _ in tags), text[:2000]  # the report, shown in the page

    text, _ = parse(
        open_page(f"{base}/#/experiments/{experiment}/models/{model_id}", "mlflow-logged-model")
    )
    metrics = re.search(r"Metrics \((\d+)\)", text)
    params = re.search(r"Parameters \((\d+)\)", text)
    assert metrics and int(metrics.group(1)) >= 5, text[:3000]
    assert params and int(params.group(1)) >= 5, text[:3000]
    assert "int8-static.speedup" in text and "config_hash" in text
    assert "Not registered" not in text
    assert re.search(rf"digits\s*v{version}", text), text[:3000]


def test_the_comparison_report_in_a_browser(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path
) -> None:
    from tests.browser import open_page, parse

    s3 = boto3.client("s3", endpoint_url=servers["s3"])
    key = digits_run["register"]["reports"]["html"].removeprefix(f"s3://{BUCKET}/")
    page = tmp_path / "comparison.html"
    page.write_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    text, tags = parse(open_page(page.as_uri(), "comparison-report", budget_ms=3000))
    assert "graphtrim comparison: models:/digits/1" in text
    images = {a.get("alt") for t, a in tags if t == "img"}
    assert {"Speed against accuracy", "Latency distributions"} <= images
    for variant in digits_run["validate"]["variants"]:
        assert any(t == "h3" and a.get("id") == f"variant-{variant}" for t, a in tags)
    assert "Pareto front" in text and "Builds" in text and "Op types" in text


def test_the_variants_page_lists_every_registered_variant(
    servers: dict[str, str], digits_run: dict[str, Any], tmp_path: Path
) -> None:
    """The registry's graphtrim variants as one table (the Airflow plugin's page), read from
    the real registry, opened in a browser."""
    from graphtrim.integrations.catalog import registered_variants, render_catalog
    from tests.browser import open_page, parse

    registry = Registry(servers["mlflow"])
    rows = registered_variants(registry)

    def row_tags(row: dict[str, Any]) -> dict[str, str]:
        return registry.version_tags(row["model"], row["version"])

    by_version = {(r["model"], r["version"]): r for r in rows}
    assert ("digits", "1") not in by_version  # the source version is no variant
    for variant, rec in digits_run["register"]["registered"].items():
        row = by_version[("digits", rec["version"])]
        numbers = digits_run["validate"]["variants"][variant]["metrics"]
        assert row["variant"] == variant and row["source"] == "1"
        assert row["gates"] == parse_gates(row_tags(row)["graphtrim.gates"])
        assert row["metrics"]["speedup"] == pytest.approx(numbers["speedup"])
    # each version's aliases as the registered model holds them now (other tests move them)
    held = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"]).get_registered_model("digits")
    assert held.aliases
    for alias, version in held.aliases.items():
        if ("digits", str(version)) in by_version:
            assert alias in by_version[("digits", str(version))]["aliases"], (alias, version)
    page = tmp_path / "variants.html"
    page.write_text(render_catalog(rows, ui=servers["mlflow"], where="the test registry"))
    text, tags = parse(open_page(page.as_uri(), "variants-page", budget_ms=2000))
    shown = {(a.get("data-model"), a.get("data-version")) for t, a in tags if t == "tr"}
    assert set(by_version) <= shown
    hrefs = [a.get("href") or "" for t, a in tags if t == "a"]
    static = digits_run["register"]["registered"]["int8-static"]["version"]
    assert f"{servers['mlflow']}/#/models/digits/versions/{static}" in hrefs
    speedup = digits_run["validate"]["variants"]["int8-static"]["metrics"]["speedup"]
    assert f"{speedup:.2f}x" in text
