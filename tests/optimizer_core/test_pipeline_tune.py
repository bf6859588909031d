"""The settings search in the pipeline (``--tune``): against a real MLflow server and S3."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask
from graphtrim.integrations.registry import TUNE_TAG, Registry
from graphtrim.stages import pipeline
from graphtrim.stages.context import PipelineConfig, PipelineError
from graphtrim.tune.memory import graph_signature
from tests.optimizer_core.test_pipeline import _config, _ctx
from tests.servers import register_onnx

pytestmark = [pytest.mark.slow]

mlflow = pytest.importorskip("mlflow")


def _children(tracking: str, run_id: str) -> list[Any]:
    client = mlflow.MlflowClient(tracking)
    experiment = client.get_run(run_id).info.experiment_id
    return list(
        client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{run_id}'", max_results=500)
    )


@pytest.fixture(scope="module")
def tuned_runs(
    servers: dict[str, str], digits_task: DigitsTask, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Two versions of the digits model through ``pipeline run`` with a search: the second
    starts from what the first remembered."""
    name = "digits-tuned"
    register_onnx(servers["mlflow"], digits_task.model, name)
    register_onnx(servers["mlflow"], digits_task.model, name)
    config = _config(digits_task, variants=("graph", "int8-static"), tune=300.0)
    tmp = tmp_path_factory.mktemp("tuned")
    first = pipeline.run_pipeline(_ctx(servers, tmp / "1"), config, f"models:/{name}/1")
    second = pipeline.run_pipeline(_ctx(servers, tmp / "2"), config, f"models:/{name}/2")
    return {"name": name, "first": first, "second": second, "config": config}


def test_each_variant_is_built_with_the_settings_its_search_found(
    servers: dict[str, str], tuned_runs: dict[str, Any]
) -> None:
    first = tuned_runs["first"]
    reg = Registry(servers["mlflow"])
    registered = first["register"]["registered"]
    for kind in ("graph", "int8-static"):
        tuning = first["quantize"]["variants"][kind]["tuning"]
        # its own knobs only: graph's search never built a quantized model
        assert tuning["key"].startswith(kind) and tuning["mode"] == "full"
        assert kind in registered, first["register"]
        tags = reg.version_tags(registered[kind]["name"], registered[kind]["version"])
        assert tags["graphtrim.tune.key"] == tuning["key"]
        assert json.loads(tags["graphtrim.tune.settings"]) == tuning["settings"]
        assert tags["graphtrim.tune.trials"] == str(tuning["trials"])
        assert tags["graphtrim.tune.signature"] == tuning["signature"]


def test_every_trial_is_a_child_run_of_the_pipeline_run(
    servers: dict[str, str], tuned_runs: dict[str, Any], tmp_path: Path
) -> None:
    first = tuned_runs["first"]
    run_id = first["export"]["run_id"]
    tunings = {k: first["quantize"]["variants"][k]["tuning"] for k in ("graph", "int8-static")}
    children = _children(servers["mlflow"], run_id)
    assert len(children) == sum(t["trials"] for t in tunings.values())
    champions = [c for c in children if c.data.tags.get("graphtrim.tune.champion") == "true"]
    assert sorted(c.data.params["tune.kind"] for c in champions) == ["graph", "int8-static"]
    for champion in champions:
        kind = champion.data.params["tune.kind"]
        assert tunings[kind]["key"] in champion.data.tags["mlflow.runName"]
        assert json.loads(champion.data.tags["graphtrim.tune.verdict"])["passed"] is True
        assert "speedup_p50" in champion.data.metrics and "size_ratio" in champion.data.metrics
    client = mlflow.MlflowClient(servers["mlflow"])
    files = {f.path for f in client.list_artifacts(run_id, "graphtrim")}
    assert {"graphtrim/tune-graph.json", "graphtrim/tune-int8-static.json"} <= files
    drawn = {f.path for f in client.list_artifacts(run_id, "graphtrim/reports/tune-int8-static")}
    assert "graphtrim/reports/tune-int8-static/tune.html" in drawn
    # the pipeline's comparison report draws each search's front beside the variants
    got = client.download_artifacts(run_id, "graphtrim/reports/comparison.html", str(tmp_path))
    page = Path(got).read_text()
    assert "<h2>Settings search</h2>" in page
    for kind, tuning in tunings.items():
        section = page.split(f'<h3 id="search-{kind}">', 1)[1].split("<h3", 1)[0]
        assert f"{tuning['trials']} trial" in section and "data:image/png;base64," in section


def test_the_next_version_starts_from_the_settings_kept_on_the_registered_model(
    servers: dict[str, str], tuned_runs: dict[str, Any]
) -> None:
    first, second = tuned_runs["first"], tuned_runs["second"]
    reg = Registry(servers["mlflow"])
    tags = reg.client.get_registered_model(tuned_runs["name"]).tags
    for kind in ("graph", "int8-static"):
        one = first["quantize"]["variants"][kind]["tuning"]
        kept = json.loads(tags[f"{TUNE_TAG}cpu.{kind}"])
        assert kept["signature"] == one["signature"]
        two = second["quantize"]["variants"][kind]["tuning"]
        assert two["mode"] == "memory"
        assert second["register"]["registered"].get(kind)
    one = first["quantize"]["variants"]["int8-static"]["tuning"]
    two = second["quantize"]["variants"]["int8-static"]["tuning"]
    assert two["trials"] < one["trials"]


def test_a_bad_budget_is_refused_before_any_work(digits_task: DigitsTask) -> None:
    for bad in (0, -5, "10m", True):
        with pytest.raises(PipelineError, match="tune"):
            PipelineConfig(tune=bad)  # type: ignore[arg-type]
    # no search: the config hashes as before the option existed
    assert PipelineConfig(tune=None).config_hash == PipelineConfig().config_hash
    assert PipelineConfig(tune=60).config_hash != PipelineConfig().config_hash


def test_the_signature_of_a_registered_model_is_the_optimized_graphs(
    digits_task: DigitsTask, tmp_path: Path
) -> None:
    """The memory is keyed on the optimized model: optimizing twice gives one signature."""
    from graphtrim.optimize_file import optimize_file

    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    optimize_file(digits_task.model, a)
    optimize_file(digits_task.model, b)
    assert graph_signature(a) == graph_signature(b)
