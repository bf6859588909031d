"""The Airflow provider: discovery, connections, placement, and the optimize DAG run through
Airflow (``dag.test``) against a real MLflow server and moto's S3 server."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from graphtrim.examples.digits import DigitsTask
from tests.conftest import BUCKET, REPO
from tests.servers import register_onnx


def test_provider_entry_point_and_info_match_airflow_schema() -> None:
    import jsonschema
    from airflow import __file__ as airflow_init

    eps = metadata.entry_points(group="apache_airflow_provider")
    ours = [ep for ep in eps if ep.value == "graphtrim.airflow:get_provider_info"]
    assert ours, [ep.value for ep in eps]
    info = ours[0].load()()
    schema = json.loads((Path(airflow_init).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(info, schema)
    hook = info["connection-types"][0]["hook-class-name"]
    module, _, name = hook.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name).conn_type == "graphtrim_mlflow"
    # every module and class it names is there, with what its section says it holds
    import importlib

    from airflow.sdk import BaseHook, BaseOperator, BaseSensorOperator
    from airflow.triggers.base import BaseTrigger

    kinds = {"hooks": BaseHook, "operators": BaseOperator, "sensors": BaseSensorOperator}
    kinds["triggers"] = BaseTrigger
    for kind, base in kinds.items():
        (entry,) = info[kind]
        assert entry["integration-name"] in {i["integration-name"] for i in info["integrations"]}
        for name in entry["python-modules"]:
            module = importlib.import_module(name)
            classes = [
                c
                for c in vars(module).values()
                if isinstance(c, type) and issubclass(c, base) and c.__module__ == name
            ]
            assert classes, (kind, name)
    # the extra links, and the stage operators show them
    from airflow.sdk import BaseOperatorLink

    from graphtrim.airflow.operators import GraphtrimStageOperator

    links = []
    for path in info["extra-links"]:
        module, _, name = path.rpartition(".")
        link = getattr(importlib.import_module(module), name)
        assert issubclass(link, BaseOperatorLink), path
        links.append(link)
    assert {type(x) for x in GraphtrimStageOperator.operator_extra_links} == set(links)
    (plugin,) = info["plugins"]
    module, _, name = plugin["plugin-class"].rpartition(".")
    assert getattr(importlib.import_module(module), name).name == plugin["name"]


@pytest.fixture
def conn_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def set_conn(conn_id: str, doc: dict[str, Any]) -> None:
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(doc))

    yield set_conn


def test_mlflow_hook_reads_the_connection_and_keeps_the_token_out_of_the_environment(
    conn_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.airflow.hooks import MlflowRegistryHook

    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    conn_env(
        "mlflow_prod",
        {
            "conn_type": "graphtrim_mlflow",
            "host": "mlflow.internal",
            "port": 5000,
            "password": "t0k",
        },
    )
    assert MlflowRegistryHook("mlflow_prod").tracking_uri() == "http://mlflow.internal:5000"
    assert MlflowRegistryHook("mlflow_prod").auth().token == "t0k"
    assert "MLFLOW_TRACKING_TOKEN" not in os.environ
    conn_env("mlflow_local", {"conn_type": "graphtrim_mlflow", "host": "sqlite:////tmp/x.db"})
    assert MlflowRegistryHook("mlflow_local").tracking_uri() == "sqlite:////tmp/x.db"


def test_mlflow_hook_without_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphtrim.airflow.hooks import MlflowRegistryHook
    from graphtrim.errors import GraphtrimError

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert MlflowRegistryHook("absent_conn").tracking_uri() == "http://from-env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(GraphtrimError, match="no Airflow connection 'absent_conn'"):
        MlflowRegistryHook("absent_conn").tracking_uri()


def test_artifact_hook_uses_the_standard_aws_connection(
    conn_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.airflow.hooks import ArtifactStoreHook

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    conn_env(
        "minio",
        {
            "conn_type": "aws",
            "login": "AKIA",
            "password": "secret",
            "extra": {"service_config": {"s3": {"endpoint_url": "http://minio:9000"}}},
        },
    )
    assert ArtifactStoreHook("minio").endpoint_url() == "http://minio:9000"
    auth = ArtifactStoreHook("minio").auth()
    assert (auth.access_key_id, auth.secret_access_key) == ("AKIA", "secret")
    assert auth.endpoint_url == "http://minio:9000"
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_SECRET_ACCESS_KEY" not in os.environ


def test_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphtrim.airflow.operators import ModelGateOperator
    from graphtrim.airflow.placement import GPU_IMAGE_ENV, placement

    monkeypatch.delenv(GPU_IMAGE_ENV, raising=False)
    assert placement("cpu") == {}
    assert placement("cpu", cpu_queue="cpu") == {"queue": "cpu"}
    gpu = placement("gpu", gpu_queue="a100", gpus=2)
    assert gpu["queue"] == "a100"
    pod = gpu["executor_config"]["pod_override"]
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": "2"}
    # the same GPU nodes as the overlay's gpu worker set
    overlay = yaml.safe_load((REPO / "helm" / "airflow-values.yaml").read_text())
    gpu_set = next(s for s in overlay["workers"]["celery"]["sets"] if s["name"] == "gpu")
    assert pod.spec.node_selector == gpu_set["nodeSelector"]
    assert [t.to_dict() for t in pod.spec.tolerations] == [
        {**t, "toleration_seconds": None, "value": None} for t in gpu_set["tolerations"]
    ]
    custom = placement("gpu", node_selector={"pool": "a100"}, tolerations=[])
    assert custom["executor_config"]["pod_override"].spec.node_selector == {"pool": "a100"}
    with pytest.raises(ValueError, match="device must be one of"):
        placement("tpu")
    op = ModelGateOperator(task_id="g", exported={}, quantized={}, device="gpu")
    assert op.queue == "gpu" and "pod_override" in op.executor_config
    # the pod template's image, unless the deployment names the GPU build (as the overlay does
    # for every Airflow pod, so the DAG processor reads it)
    assert pod.spec.containers[0].image is None
    image = next(e["value"] for e in overlay["env"] if e["name"] == GPU_IMAGE_ENV)
    monkeypatch.setenv(GPU_IMAGE_ENV, image)
    base = placement("gpu")["executor_config"]["pod_override"].spec.containers[0]
    assert base.image == image == "ghcr.io/graphtrim/graphtrim:0.1.0-airflow-gpu"


def test_every_stage_has_its_operator_taking_the_records_it_takes() -> None:
    """The operators are derived from ``STAGES``: one per stage, each templating the records its
    stage function takes (by ``record_arg``), all running through the generic operator."""
    import inspect

    from graphtrim.airflow import operators
    from graphtrim.stages import STAGES, record_arg

    found = {
        cls.stage_name: cls
        for cls in vars(operators).values()
        if isinstance(cls, type)
        and issubclass(cls, operators.GraphtrimStageOperator)
        and cls.stage_name is not None
    }
    assert sorted(found) == sorted(s.name for s in STAGES)
    for s in STAGES:
        cls = found[s.name]
        assert cls.execute is operators.GraphtrimStageOperator.execute, cls
        wanted = [record_arg(n) for n in s.args] if s.inputs else ["model_uri"]
        assert set(wanted) <= set(cls.template_fields), (s.name, cls.template_fields)
        assert set(wanted) <= set(inspect.signature(cls.__init__).parameters), s.name


def test_the_generic_operator_calls_the_stage_the_list_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its XCom is the record's JSON, the validate records of a mapped task merged first."""
    import sys

    from graphtrim.airflow import operators
    from graphtrim.stages import STAGES, Stage, records

    calls: list[Any] = []

    def fake(ctx: Any, config: Any, validated: Any) -> Any:
        calls.append(validated)
        return records.PromoteRecord(run_id=validated.run_id, aliases={"a": 1})

    monkeypatch.setattr(sys.modules[__name__], "fake_stage", fake, raising=False)
    extra = Stage("judge", ("validate",), "x", function=f"{__name__}:fake_stage")
    monkeypatch.setattr("graphtrim.stages.STAGES", (*STAGES, extra))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    one = {"stage": "validate", "run_id": "r", "variants": {"g": {"passed": True}}, "worker": {}}
    two = {**one, "variants": {"h": {"passed": False}}}
    op = operators.GraphtrimStageOperator(
        task_id="judge", stage="judge", validated=[one, two], artifacts=str(tmp_path)
    )
    xcom = op.execute({"run_id": "r"})
    assert xcom == {
        "stage": "promote",
        "run_id": "r",
        "aliases": {"a": 1},
        "champion": {},
        "worker": {},
    }
    assert type(xcom) is dict
    (merged,) = calls
    assert merged.passed == ["g"] and list(merged.variants) == ["g", "h"]


def test_the_operator_of_an_added_stage_takes_the_record_of_one_by_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage without a named operator gets one from the list: its records (here that of
    promote, which no earlier stage reads) are templated arguments named by ``record_arg``."""
    import sys

    from graphtrim.airflow.pipeline import stage_operator
    from graphtrim.stages import STAGES, Stage, records

    calls: list[Any] = []

    def fake(ctx: Any, config: Any, promoted: Any) -> Any:
        calls.append(promoted)
        return records.PromoteRecord(run_id=promoted["run_id"], aliases={})

    monkeypatch.setattr(sys.modules[__name__], "fake_audit", fake, raising=False)
    audit = Stage("audit", ("promote",), "x", function=f"{__name__}:fake_audit")
    monkeypatch.setattr("graphtrim.stages.STAGES", (*STAGES, audit))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cls = stage_operator(audit)
    assert cls.stage_name == "audit" and "promoted" in cls.template_fields
    promoted = {"stage": "promote", "run_id": "r", "aliases": {"a": 1}}
    op = cls(task_id="audit", promoted=promoted, artifacts=str(tmp_path))
    assert op.execute({"run_id": "r"})["run_id"] == "r"
    assert calls == [promoted]


def test_stage_operators_pass_allow_variant_source_to_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.airflow.operators import MlflowModelExportOperator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def ctx(**kw: Any) -> Any:
        op = MlflowModelExportOperator(
            task_id="export", model_uri="models:/m/1", artifacts=str(tmp_path), **kw
        )
        assert "allow_variant_source" in op.template_fields
        return op.stage_context({"run_id": "r"})

    assert ctx().allow_variant_source is False
    assert ctx(allow_variant_source=True).allow_variant_source is True
    # rendered from the plan task's XCom, it may arrive as text
    assert ctx(allow_variant_source="True").allow_variant_source is True
    assert ctx(allow_variant_source="False").allow_variant_source is False
    for flag in ("rejudge", "force_promotion"):
        assert getattr(ctx(), flag) is False
        assert getattr(ctx(**{flag: "True"}), flag) is True


# ---------------------------------------------------------------------------- end to end


def _optimize_dag(servers: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The CPU optimize DAG, its connections at the test servers."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_DEFAULT",
        json.dumps({"conn_type": "graphtrim_mlflow", "host": servers["mlflow"]}),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_DEFAULT",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "testing",
                "password": "testing",
                "extra": {"endpoint_url": servers["s3"], "region_name": "us-east-1"},
            }
        ),
    )
    return DagBag(str(REPO / "dags")).dags["graphtrim_optimize_model"]


@pytest.mark.slow
def test_optimize_dag_through_airflow_with_mlflow_server_and_s3(
    servers: dict[str, str],
    airflow_db: str,
    digits_task: DigitsTask,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    import mlflow

    version = register_onnx(servers["mlflow"], digits_task.model, "digits-airflow")
    dag = _optimize_dag(servers, monkeypatch)
    policy = {
        "variants": {
            v: {"latency": {"min_speedup": None, "runs": 60, "warmup": 10}}
            for v in ("graph", "int8-static")
        },
        "promotion": {"metric": "bytes"},
    }
    conf = {
        "model_name": "digits-airflow",
        "version": version,
        "variants": ["graph", "int8-static"],
        "policy": policy,
        "calibration": str(digits_task.calibration),
        "eval_data": str(digits_task.eval),
        "artifacts": f"s3://{BUCKET}/airflow",
    }
    run = dag.test(run_conf=conf)
    assert str(run.state) in ("success", "DagRunState.SUCCESS"), run.state
    tis = {(ti.task_id, ti.map_index): str(ti.state) for ti in run.get_task_instances()}
    # every stage ran as its own task instance; one quantize and one gate per variant
    expected = {
        ("plan", -1),
        ("variants", -1),
        ("export", -1),
        ("optimize", -1),
        ("quantize", 0),
        ("quantize", 1),
        ("gate", 0),
        ("gate", 1),
        ("register", -1),
        ("promote", -1),
        ("summary", -1),
        # no settings search asked: its plan and selects end at once, its rounds are skipped
        ("tune.plan", -1),
        *((f"tune.select_{r}", -1) for r in range(5)),
        *((f"tune.trial_{r}", -1) for r in range(5)),
    }
    assert set(tis) == expected
    assert all(
        s.endswith("skipped" if t.startswith("tune.trial") else "success")
        for (t, _), s in tis.items()
    ), tis

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    found = client.search_model_versions(
        "name='digits-airflow' and tags.`graphtrim.source.version`='" + version + "'"
    )
    by_variant = {v.tags["graphtrim.variant"]: v for v in found}
    assert set(by_variant) == {"graph", "int8-static"}
    for v in by_variant.values():
        assert v.tags["graphtrim.orchestrator_run_id"] == (
            f"airflow:graphtrim_optimize_model:{run.run_id}"
        )
        assert v.tags["graphtrim.artifact"].startswith(f"s3://{BUCKET}/airflow/digits-airflow/")
    # each stage says where it ran: the task's queue and id, per variant for the mapped ones
    run_tags = client.get_run(by_variant["graph"].tags["graphtrim.pipeline_run_id"]).data.tags
    for label in ("export", "optimize", "quantize.graph", "validate.int8-static", "register"):
        where = json.loads(run_tags[f"graphtrim.worker.{label}"])
        assert where["queue"] == "default" and where["task"] == label.split(".")[0].replace(
            "validate", "gate"
        ), (label, where)
    champion = client.get_model_version_by_alias("digits-airflow", "champion")
    assert champion.version == by_variant["int8-static"].version

    # the tasks' extra links, as Airflow stored them when each task ended
    links = _links(run.run_id)
    pipeline_run = by_variant["graph"].tags["graphtrim.pipeline_run_id"]
    experiment = client.get_run(pipeline_run).info.experiment_id
    base = servers["mlflow"]
    register = links[("register", -1)]
    assert register["MlflowRunLink"] == f"{base}/#/runs/{pipeline_run}"
    assert register["MlflowModelVersionLink"] == f"{base}/#/models/digits-airflow"
    artifacts = f"{base}/#/experiments/{experiment}/runs/{pipeline_run}/artifacts"
    assert register["GraphtrimReportLink"] == f"{artifacts}/graphtrim/reports/comparison.html"
    gate = links[("gate", 0)]
    assert gate["GraphtrimReportLink"].startswith(f"{artifacts}/graphtrim/reports/evaluation")
    assert gate["MlflowModelVersionLink"] == ""  # a gate registers nothing: the link is off
    _check_airflow_ui(run.run_id, register, {v.version for v in by_variant.values()})

    # Asset events for downstream DAGs: a version registered, an alias moved
    events = _asset_events(run.run_id)
    uri = "x-mlflow://registered-models/digits-airflow"
    registered = sorted(
        (e["variant"], e["version"]) for t, u, e in events if t == "register" and u == uri
    )
    assert registered == sorted((k, v.version) for k, v in by_variant.items()), events
    moved = {(e["alias"], e["version"]) for t, u, e in events if t == "promote" and u == uri}
    assert ("champion", by_variant["int8-static"].version) in moved, events
    assert ("graph-candidate", by_variant["graph"].version) in moved, events
    assert (
        client.get_model_version_by_alias("digits-airflow", "graph-candidate").version
        == by_variant["graph"].version
    )

    # a second run of the DAG registers nothing new
    before = len(client.search_model_versions("name='digits-airflow'"))
    again = dag.test(run_conf=conf)
    assert str(again.state).endswith("success")
    assert len(client.search_model_versions("name='digits-airflow'")) == before
    assert _asset_events(again.run_id) == []  # nothing registered, no alias moved

    # a variant graphtrim registered is no source: the export task fails (no retry), nothing
    # is registered
    variant = by_variant["graph"].version
    refused = dag.test(run_conf={**conf, "version": variant, "variants": ["graph"]})
    states = {ti.task_id: str(ti.state) for ti in refused.get_task_instances()}
    assert states["export"].endswith("failed"), states
    out = capfd.readouterr()
    assert f"models:/digits-airflow/{variant} is a graphtrim variant" in out.out + out.err
    assert len(client.search_model_versions("name='digits-airflow'")) == before


@pytest.mark.slow
def test_a_settings_search_runs_a_task_per_trial_over_the_workers(
    servers: dict[str, str],
    airflow_db: str,
    digits_task: DigitsTask,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow

    name = "digits-airflow-tune"
    version = register_onnx(servers["mlflow"], digits_task.model, name)
    dag = _optimize_dag(servers, monkeypatch)
    # the trials run where the variant does: the device's queue, under the DAG's pool
    assert dag.task_dict["tune.trial_0"].queue == dag.task_dict["quantize"].queue
    conf = {
        "model_name": name,
        "version": version,
        "variants": ["int8-dynamic"],
        "policy": {
            "variants": {"int8-dynamic": {"latency": {"min_speedup": None, "runs": 60}}},
        },
        "calibration": str(digits_task.calibration),
        "eval_data": str(digits_task.eval),
        "artifacts": f"s3://{BUCKET}/airflow-tune",
        "tune": "3m",
    }
    run = dag.test(run_conf=conf)
    assert str(run.state).endswith("success"), run.state
    tis = run.get_task_instances()
    trials = [ti for ti in tis if ti.task_id.startswith("tune.trial_")]
    by_round: dict[str, list[Any]] = {}
    for ti in trials:
        by_round.setdefault(ti.task_id, []).append(ti)
    # round 0: the fixed recipe; round 1: its neighbours, side by side, a task instance each
    assert [ti.map_index for ti in by_round["tune.trial_0"]] == [0]
    assert len(by_round["tune.trial_1"]) > 1, by_round
    ran = [ti for ti in trials if str(ti.state).endswith("success")]
    # each instance is named after its trial in the UI
    names = sorted(str(ti.rendered_map_index) for ti in ran)
    assert all(n.split(" ", 1)[1].startswith("int8-dynamic") for n in names), names
    assert sorted(int(n.split(" ")[0]) for n in names) == list(range(1, len(ran) + 1))

    client = mlflow.MlflowClient(servers["mlflow"], servers["mlflow"])
    (registered,) = client.search_model_versions(
        f"name='{name}' and tags.`graphtrim.source.version`='{version}'"
    )
    tags = registered.tags
    assert tags["graphtrim.variant"] == "int8-dynamic"
    assert tags["graphtrim.tune.key"].startswith("int8-dynamic")
    # every trial task's result reached the judgement, and each trial is a child run
    assert int(tags["graphtrim.tune.trials"]) == len(ran)
    pipeline_run = tags["graphtrim.pipeline_run_id"]
    experiment = client.get_run(pipeline_run).info.experiment_id
    children = client.search_runs(
        [experiment], f"tags.`mlflow.parentRunId` = '{pipeline_run}'", max_results=500
    )
    assert len(children) == len(ran)
    assert sum(c.data.tags["graphtrim.tune.champion"] == "true" for c in children) == 1


def _check_airflow_ui(run_id: str, links: dict[str, str], versions: set[str]) -> None:
    """Airflow's UI in a real browser (an API server on this process's database, every user an
    admin): the register task's page shows its extra links, the graphtrim plugin is in the
    navigation and its page lists the variants the run registered."""
    from tests.browser import open_page, parse
    from tests.servers import airflow_api_server

    env = dict(os.environ, AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True")
    log = Path(os.environ["AIRFLOW_HOME"]) / "api-server-ui.log"
    with airflow_api_server(env, log) as url:
        task = f"{url}/dags/graphtrim_optimize_model/runs/{run_id}/tasks/register/details"
        text, tags = parse(open_page(task, "airflow-register-task"))
        anchors = {}
        for tag, attrs in tags:
            if tag == "a" and attrs.get("href"):
                anchors[attrs["href"]] = attrs
        assert "Extra Links" in text, text[:3000]
        for name in ("MlflowRunLink", "MlflowModelVersionLink", "GraphtrimReportLink"):
            assert links[name] in anchors, (name, links[name], list(anchors)[:40])
        assert "MLflow run" in text and "MLflow model version" in text
        assert "graphtrim report" in text

        _, tags = parse(open_page(f"{url}/plugin/graphtrim-variants", "airflow-plugin"))
        frames = [a for t, a in tags if t == "iframe"]
        assert [f.get("src") for f in frames] == ["/graphtrim/variants"], frames
        text, tags = parse(open_page(f"{url}/graphtrim/variants", "airflow-variants-page"))
        shown = {
            a.get("data-version")
            for t, a in tags
            if t == "tr" and a.get("data-model") == "digits-airflow"
        }
        assert versions <= shown, (versions, shown, text[:2000])


def _asset_events(run_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(task, asset URI, extra) of every Asset event the DAG run's tasks emitted."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(
            select(AssetEvent.source_task_id, AssetModel.uri, AssetEvent.extra)
            .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
            .where(AssetEvent.source_run_id == run_id)
        ).all()
    return [(t, u, dict(e or {})) for t, u, e in rows]


def _links(run_id: str) -> dict[tuple[str, int], dict[str, str]]:
    """The extra links' URLs Airflow stored for each task instance of the DAG run."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    out: dict[tuple[str, int], dict[str, str]] = {}
    with create_session() as session:
        rows = session.execute(
            select(XComModel.task_id, XComModel.map_index, XComModel.key, XComModel.value).where(
                XComModel.run_id == run_id, XComModel.key.like("_link_%")
            )
        ).all()
    for task, index, key, value in rows:
        try:
            url = json.loads(value) if isinstance(value, str | bytes) else value
        except ValueError:  # stored as the bare string
            url = value
        out.setdefault((task, index), {})[key.removeprefix("_link_")] = url
    return out


def test_a_dag_run_without_a_policy_takes_the_workers_deployment_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Helm overlay mounts the gate policy and sets GRAPHTRIM_POLICY on the workers: a DAG
    run whose conf names no policy plans with that document in its config (what every later
    task judges by); a policy in the conf wins."""
    from graphtrim.airflow.run_plan import plan_run

    policy = tmp_path / "gates.yaml"
    policy.write_text("variants:\n  int8-static: {size: {max_ratio: 0.2}}\n")
    monkeypatch.setenv("GRAPHTRIM_POLICY", str(policy))
    conf = {"model_name": "m", "version": "1", "variants": ["graph"], "preset": "default"}
    planned = plan_run(conf, "cpu")
    assert planned["config"]["policy"]["variants"] == {"int8-static": {"size": {"max_ratio": 0.2}}}
    own = {"variants": {"graph": {"size": {"max_ratio": 0.9}}}}
    assert plan_run({**conf, "policy": own}, "cpu")["config"]["policy"] == own
    # a misspelt variant in the deployment's policy fails the run before any work
    policy.write_text("variants:\n  int8_static: {size: {max_ratio: 0.2}}\n")
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="int8_static"):
        plan_run(conf, "cpu")


def test_a_dag_run_asks_for_a_settings_search() -> None:
    """The ``tune`` param (a duration) reaches the config as seconds; a bad one fails the run
    before any work."""
    from airflow.sdk.exceptions import AirflowFailException

    from graphtrim.airflow.run_plan import plan_run

    conf = {"model_name": "m", "version": "1", "variants": ["int8-static"], "preset": "default"}
    assert plan_run(conf, "cpu")["config"]["tune"] is None
    assert plan_run({**conf, "tune": ""}, "cpu")["config"]["tune"] is None
    assert plan_run({**conf, "tune": "10m"}, "cpu")["config"]["tune"] == 600.0
    assert plan_run({**conf, "tune": "90"}, "gpu")["config"]["tune"] == 90.0
    with pytest.raises(AirflowFailException, match="not a duration"):
        plan_run({**conf, "tune": "ten minutes"}, "cpu")


def test_a_dag_run_raises_the_opset_before_the_graph_passes() -> None:
    """The ``opset`` param reaches the config the optimize task reads; one this onnx does not
    know fails the run before any work."""
    from airflow.sdk.exceptions import AirflowFailException

    from graphtrim.airflow.run_plan import plan_run

    conf = {"model_name": "m", "version": "1", "variants": ["graph"], "preset": "default"}
    assert plan_run(conf, "cpu")["config"]["opset"] is None
    assert plan_run({**conf, "opset": 23}, "cpu")["config"]["opset"] == 23
    with pytest.raises(AirflowFailException, match="opset: 99"):
        plan_run({**conf, "opset": 99}, "cpu")


def test_a_dag_run_chooses_the_weight_only_settings() -> None:
    """The ``weights`` param reaches the config every later task builds from; settings no
    variant can take fail the run before any work."""
    from airflow.sdk.exceptions import AirflowFailException

    from graphtrim.airflow.run_plan import plan_run

    conf = {"model_name": "m", "version": "1", "variants": ["int4-weight"], "preset": "default"}
    plain = plan_run(conf, "cpu")["config"]
    assert plain["weights"] is None
    wanted = {"weight_form": "ort", "quantize_embeddings": True}
    assert plan_run({**conf, "weights": wanted}, "cpu")["config"]["weights"] == wanted
    with pytest.raises(AirflowFailException, match="embedding tables"):
        plan_run({**conf, "weights": {"quantize_embeddings": True}}, "cpu")  # portable form
    with pytest.raises(AirflowFailException, match="unknown weight setting"):
        plan_run({**conf, "weights": {"form": "ort"}}, "cpu")
