"""A settings search over workers cleans up after itself: after the judgement the artifact store
holds the champion's trial model only (counted in the S3 server), a retried judgement comes to
the same champion, and ``GRAPHTRIM_KEEP_TRIALS`` keeps every trial model. The trial steps read
their inputs through the worker's input cache."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask
from graphtrim.integrations.entries import LocalStore
from graphtrim.integrations.model_files import MANIFEST
from graphtrim.stages import pipeline, tune
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.quantize_tune import KEEP_TRIALS_ENV, _clean_trials
from tests.conftest import BUCKET
from tests.optimizer_core.test_pipeline import _config
from tests.servers import register_onnx

pytestmark = [pytest.mark.slow]

boto3 = pytest.importorskip("boto3")


def _entries(s3: Any, prefix: str) -> dict[str, set[str]]:
    """The complete entries under ``prefix`` (their manifests), by stage."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    out: dict[str, set[str]] = {}
    for page in pages:
        for obj in page.get("Contents", []):
            parts = obj["Key"][len(prefix) + 1 :].split("/")
            if len(parts) == 5 and parts[-1] == MANIFEST:  # model/version/stage/sha/manifest
                out.setdefault(parts[2], set()).add(parts[3])
    return out


def _keys(s3: Any, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def test_after_the_judgement_the_store_holds_the_champion_only(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRAPHTRIM_INPUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(KEEP_TRIALS_ENV, raising=False)
    prefix = f"cleanup-{uuid.uuid4().hex[:8]}"
    ctx = StageContext(
        servers["mlflow"],
        f"s3://{BUCKET}/{prefix}",
        workdir=str(tmp_path / "work"),
        s3_endpoint_url=servers["s3"],
    )
    name = f"digits-cleanup-{uuid.uuid4().hex[:6]}"
    version = register_onnx(servers["mlflow"], digits_task.model, name)
    config = _config(digits_task, variants=("int8-dynamic",), tune=120.0)
    exp = pipeline.export(ctx, config, f"models:/{name}/{version}")
    config = PipelineConfig.from_json(exp["config"])
    opt = pipeline.optimize(ctx, config, exp)

    # the search as an orchestrator runs it: a plan, then rounds of trial steps and a select
    step = tune.tune_plan(ctx, config, exp, opt, rounds=2)
    while step["batch"]:
        results = [tune.tune_trial(ctx, config, exp, opt, t) for t in step["batch"]]
        step = tune.tune_select(ctx, config, step["search"], results)
    trials = step["search"]["kinds"]["int8-dynamic"]["trials"]
    stored = {t["uri"].rsplit("/", 1)[1] for t in trials if t.get("uri")}
    assert len(stored) >= 2, trials  # N feasible trials, each a model in the store
    s3 = boto3.client("s3", endpoint_url=servers["s3"])
    assert _entries(s3, prefix)["tune-int8-dynamic"] == stored
    # every trial step read the reference and the optimized model from this worker's cache
    cached = {p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")}
    assert cached == {exp["model"]["sha256"], opt["model"]["sha256"]}

    record = pipeline.quantize(ctx, config, exp, opt, tuned=step["search"])
    tuning = record.variants["int8-dynamic"]["tuning"]
    champion = next(t for t in trials if t["key"] == tuning["key"])
    entries = _entries(s3, prefix)
    assert entries["tune-int8-dynamic"] == {champion["uri"].rsplit("/", 1)[1]}
    # nothing of the deleted entries is left behind either (no orphan model or data file)
    best = champion["uri"].rsplit("/", 1)[1]
    left = [k for k in _keys(s3, prefix) if "/tune-int8-dynamic/" in k and f"/{best}/" not in k]
    assert left == []

    # a retried judgement (the task cleared, its worker lost) finds the champion's model and
    # comes to the same champion
    again = pipeline.quantize(ctx, config, exp, opt, tuned=step["search"])
    assert again.variants["int8-dynamic"]["tuning"]["key"] == tuning["key"]
    assert again.variants["int8-dynamic"]["model"] == record.variants["int8-dynamic"]["model"]
    assert _entries(s3, prefix)["tune-int8-dynamic"] == {champion["uri"].rsplit("/", 1)[1]}


def _trial_store(tmp_path: Path, n: int) -> tuple[LocalStore, list[dict[str, Any]]]:
    import onnx
    import onnx.helper as oh

    store = LocalStore(tmp_path / "store")
    trials = []
    for i in range(n):
        graph = oh.make_graph(
            [oh.make_node("Identity", ["x"], ["y"], name=f"n{i}")],
            f"g{i}",
            [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
        path = tmp_path / f"m{i}" / "model.onnx"
        path.parent.mkdir()
        onnx.save(oh.make_model(graph), str(path))
        uri = store.put_model(path, model="m", version="1", stage="tune-fp16").uri
        trials.append({"number": i + 1, "uri": uri})
    trials.append({"number": n + 1, "uri": None})  # an infeasible trial: nothing stored
    return store, trials


def test_a_setting_keeps_the_trial_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, trials = _trial_store(tmp_path, 3)
    ctx = StageContext("sqlite:///unused.db", str(tmp_path / "store"))
    entries = tmp_path / "store" / "m" / "1" / "tune-fp16"
    monkeypatch.setenv(KEEP_TRIALS_ENV, "1")
    _clean_trials(ctx, store, trials, champion=2)
    assert len(list(entries.iterdir())) == 3
    monkeypatch.delenv(KEEP_TRIALS_ENV)
    _clean_trials(ctx, store, trials, champion=2)
    assert [p.name for p in entries.iterdir()] == [trials[1]["uri"].rsplit("/", 1)[1]]
    _clean_trials(ctx, store, trials, champion=None)  # no champion: every trial model goes
    assert list(entries.iterdir()) == []
