"""Registry events: the new-version trigger, the deferrable sensor, the webhook endpoint and the
registry scan, against a real MLflow server and a real Airflow metadata database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from graphtrim.examples.digits import DigitsTask
from tests.servers import register_onnx

pytestmark = [pytest.mark.slow]


def _register_variant(tracking: str, name: str, of_version: str, variant: str) -> str:
    """Register a version of ``name`` the way graphtrim registers a variant it built (its
    ``graphtrim.variant`` and ``graphtrim.key`` tags set at creation); the model is the one of
    ``of_version``."""
    from graphtrim.integrations.registry import Registry

    registry = Registry(tracking)
    source = registry.client.get_model_version(name, of_version)
    version, created = registry.register(
        str(source.source),
        name,
        tags={"graphtrim.variant": variant, "graphtrim.source.version": of_version},
        key=f"test-{uuid.uuid4().hex}",
    )
    assert created
    return version


def _skips(caplog: pytest.LogCaptureFixture, name: str, version: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(f"skipping {name} v{version}: a graphtrim variant")
    ]


def _quiet_polls(trigger: Any) -> list[int]:
    """Counts (one entry each) the polls of a new-version trigger that claimed nothing: after
    one, every version pending when it started has been claimed (or passed over)."""
    quiet: list[int] = []
    claim = trigger._claim

    def counted(client: Any) -> Any:
        event = claim(client)
        if event is None:
            quiet.append(1)
        return event

    trigger._claim = counted
    return quiet


async def _events(
    trigger: Any, until: Callable[[list[dict[str, Any]]], bool], limit: float = 900
) -> list[dict[str, Any]]:
    """Every event the trigger yields until ``until(events)`` holds or its run ends.

    What ends the wait is what the trigger did (its polls, its events), not a time: on a busy
    machine one poll of the registry may take seconds. ``limit`` only guards against a hang.
    """
    out: list[dict[str, Any]] = []

    async def collect() -> None:
        async for event in trigger.run():
            out.append(event.payload)

    task = asyncio.ensure_future(collect())
    deadline = time.monotonic() + limit
    try:
        while not task.done() and not until(out):
            assert time.monotonic() < deadline, f"the trigger hung; events so far: {out}"
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return out


def _new_events(trigger: Any, polls: int = 3) -> list[dict[str, Any]]:
    """The events of a new-version trigger until it has polled ``polls`` times and found
    nothing new."""
    quiet = _quiet_polls(trigger)
    return asyncio.run(_events(trigger, lambda _: len(quiet) >= polls))


def test_new_version_trigger_fires_once_per_version(
    servers: dict[str, str], digits_task: DigitsTask
) -> None:
    from graphtrim.airflow.triggers import MlflowNewModelVersionTrigger

    name = f"watched-{uuid.uuid4().hex[:6]}"
    register_onnx(servers["mlflow"], digits_task.model, name, **{"graphtrim.optimize": "true"})
    register_onnx(servers["mlflow"], digits_task.model, f"{name}-unwatched")

    def trigger() -> MlflowNewModelVersionTrigger:
        return MlflowNewModelVersionTrigger(
            watcher="test", tracking_uri=servers["mlflow"], poll_interval=0.2
        )

    # first sight: what exists is not new
    assert [e for e in _new_events(trigger()) if e["name"] == name] == []
    v2 = register_onnx(servers["mlflow"], digits_task.model, name)
    register_onnx(servers["mlflow"], digits_task.model, f"{name}-unwatched")
    fired = [e for e in _new_events(trigger()) if e["name"].startswith(name)]
    assert fired == [{"name": name, "version": v2, "model_uri": f"models:/{name}/{v2}"}]
    # a restarted trigger (new instance, same watcher) does not fire it again
    assert [e for e in _new_events(trigger()) if e["name"] == name] == []
    # a serialized round trip (what the triggerer stores) keeps the arguments
    path, kwargs = trigger().serialize()
    assert path == "graphtrim.airflow.triggers.MlflowNewModelVersionTrigger"
    assert kwargs["watcher"] == "test" and kwargs["tracking_uri"] == servers["mlflow"]


def test_new_version_trigger_passes_over_graphtrim_variants(
    servers: dict[str, str], digits_task: DigitsTask, caplog: pytest.LogCaptureFixture
) -> None:
    from graphtrim.airflow.triggers import MlflowNewModelVersionTrigger

    tracking = servers["mlflow"]
    name = f"looped-{uuid.uuid4().hex[:6]}"
    v1 = register_onnx(tracking, digits_task.model, name, **{"graphtrim.optimize": "true"})

    def fired(allow: bool = False, polls: int = 15) -> list[dict[str, Any]]:
        trigger = MlflowNewModelVersionTrigger(
            watcher="loop",
            tracking_uri=tracking,
            poll_interval=0.2,
            allow_variant_source=allow,
        )
        return [e for e in _new_events(trigger, polls) if e["name"] == name]

    assert fired() == []  # first sight: the watermark
    variant = _register_variant(tracking, name, v1, "int8-static")
    v_new = register_onnx(tracking, digits_task.model, name)
    with caplog.at_level(logging.INFO):
        # polled 15 times: the variant fires nothing and is said to be skipped once
        assert fired() == [{"name": name, "version": v_new, "model_uri": f"models:/{name}/{v_new}"}]
        assert fired(polls=5) == []
    assert _skips(caplog, name, variant) == [
        f"skipping {name} v{variant}: a graphtrim variant (graphtrim.variant=int8-static); "
        "allow_variant_source=True to optimize it"
    ]
    # asked for explicitly, a variant fires, and says so in its event
    again = _register_variant(tracking, name, v1, "fp16")
    assert fired(allow=True) == [
        {
            "name": name,
            "version": again,
            "model_uri": f"models:/{name}/{again}",
            "allow_variant_source": True,
        }
    ]
    _, kwargs = MlflowNewModelVersionTrigger(allow_variant_source=True).serialize()
    assert kwargs["allow_variant_source"] is True


def test_sensor_defers_then_completes(
    servers: dict[str, str], digits_task: DigitsTask, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from graphtrim.airflow import triggers
    from graphtrim.airflow.sensors import MlflowModelVersionSensor
    from graphtrim.airflow.triggers import MlflowModelVersionTrigger
    from graphtrim.errors import GraphtrimError

    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_DEFAULT",
        json.dumps({"conn_type": "graphtrim_mlflow", "host": servers["mlflow"]}),
    )
    name = f"sensed-{uuid.uuid4().hex[:6]}"
    register_onnx(servers["mlflow"], digits_task.model, name)
    # the sensor's timeout is far above what registering a version can take on a busy machine:
    # this test is about finding the version, the timeout event is checked below
    sensor = MlflowModelVersionSensor(task_id="wait", model_name=name, version="2", timeout=3600)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trig = deferred.value.trigger
    assert isinstance(trig, MlflowModelVersionTrigger)
    trig.poll_interval = 0.2
    polls: list[str | None] = []
    find = triggers.find_version

    def counted(*args: Any) -> str | None:
        polls.append(find(*args))
        return polls[-1]

    monkeypatch.setattr(triggers, "find_version", counted)
    # version 2 does not exist yet: polled three times, nothing found, no event
    assert asyncio.run(_events(trig, lambda _: len(polls) >= 3)) == []
    assert polls[:3] == [None, None, None]
    register_onnx(servers["mlflow"], digits_task.model, name)
    events = asyncio.run(_events(trig, bool))  # the trigger ends with its event
    assert events == [{"status": "found", "name": name, "version": "2"}]
    assert sensor.execute_complete({}, events[0]) == {"name": name, "version": "2"}
    # present already: no deferral at all
    assert sensor.execute({}) == {"name": name, "version": "2"}
    with pytest.raises(GraphtrimError, match="did not appear in time"):
        sensor.execute_complete({}, {"status": "timeout", "name": name})
    alias = MlflowModelVersionSensor(task_id="a", model_name=name, alias="nope", deferrable=False)
    assert alias.poke({}).is_done is False


# ---------------------------------------------------------------------------- webhooks


@pytest.fixture(scope="module")
def serialized_dags(airflow_db: str) -> str:
    """The repository's DAGs serialized into this process's Airflow database."""
    subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "dags", "reserialize"],
        check=True,
        capture_output=True,
        env=dict(os.environ),
    )
    return airflow_db


def _runs(dag_id: str) -> list[Any]:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        return list(session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).all())


def _post(client: Any, secret: str, payload: dict[str, Any], **over: Any) -> Any:
    from graphtrim.airflow.plugin import sign

    body = json.dumps(payload).encode()
    delivery = over.pop("delivery", uuid.uuid4().hex)
    stamp = over.pop("timestamp", str(int(time.time())))
    headers = {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": over.pop("signature", sign(secret, delivery, stamp, body)),
        "Content-Type": "application/json",
    }
    for k in over.pop("drop", ()):
        headers.pop(k)
    return client.post("/mlflow-webhook", content=body, headers=headers)


def test_webhook_triggers_one_run_and_refuses_bad_requests(serialized_dags: str) -> None:
    from fastapi.testclient import TestClient

    from graphtrim.airflow.plugin import create_app

    secret = "s3cret"
    dag_id = "graphtrim_optimize_model"
    token = uuid.uuid4().hex

    def run_for(name: str, version: str) -> dict[str, Any]:  # the version's run, no registry
        return {"conf": {"model_name": name, "version": version}, "run_id": f"{token}__v{version}"}

    client = TestClient(create_app(secret=secret, dag_id=dag_id, run_for=run_for))
    event = {
        "entity": "model_version",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {
            "name": "digits",
            "version": "7",
            "source": "models:/m-1",
            "run_id": "r",
            "tags": {},
        },
    }
    before = len(_runs(dag_id))
    delivery = uuid.uuid4().hex
    ok = _post(client, secret, event, delivery=delivery)
    assert ok.status_code == 200, ok.text
    assert ok.json()["status"] == "triggered"
    runs = [r for r in _runs(dag_id) if r.run_id == f"{token}__v7"]
    assert len(runs) == 1
    assert runs[0].conf == {"model_name": "digits", "version": "7"}

    # replayed delivery id: acknowledged, nothing new (also from a fresh app: the run id is the
    # version's, durable)
    assert _post(client, secret, event, delivery=delivery).json()["status"] == "duplicate"
    fresh = TestClient(create_app(secret=secret, dag_id=dag_id, run_for=run_for))
    assert _post(fresh, secret, event, delivery=delivery).json()["status"] == "duplicate"
    # bad signature, unsigned, stale, malformed timestamp: refused
    assert _post(client, secret, event, signature="v1,AAAA").status_code == 401
    assert _post(client, "other-secret", event).status_code == 401
    assert _post(client, secret, event, drop=["X-MLflow-Signature"]).status_code == 401
    stale = str(int(time.time()) - 3600)
    assert _post(client, secret, event, timestamp=stale).status_code == 400
    assert _post(client, secret, event, timestamp="yesterday").status_code == 400
    assert len(_runs(dag_id)) == before + 1
    # events it does not handle are acknowledged and ignored
    other = {**event, "entity": "registered_model"}
    assert _post(client, secret, other).json()["status"] == "ignored"
    assert len(_runs(dag_id)) == before + 1


def test_webhook_passes_over_graphtrim_variants_unless_allowed(
    servers: dict[str, str],
    digits_task: DigitsTask,
    serialized_dags: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fastapi.testclient import TestClient
    from mlflow import MlflowClient

    from graphtrim.airflow.plugin import create_app
    from graphtrim.stages.context import StageContext
    from graphtrim.stages.scan import conf_for

    tracking = servers["mlflow"]
    # the API server reads tags the event lacks through this connection
    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_WEBHOOK",
        json.dumps({"conn_type": "graphtrim_mlflow", "host": tracking}),
    )
    monkeypatch.setenv("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", "mlflow_webhook")
    monkeypatch.delenv("GRAPHTRIM_ALLOW_VARIANT_SOURCE", raising=False)
    name = f"hooked-{uuid.uuid4().hex[:6]}"
    source = register_onnx(tracking, digits_task.model, name)
    variant = _register_variant(tracking, name, source, "int8-static")
    variant_tags = dict(MlflowClient(tracking, tracking).get_model_version(name, variant).tags)
    secret, dag_id = "s3cret", "graphtrim_optimize_model"
    client = TestClient(create_app(secret=secret, dag_id=dag_id))
    created = {
        "entity": "model_version",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {"name": name, "version": variant, "source": "models:/m-1", "tags": variant_tags},
    }
    alias = {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {"name": name, "alias": "champion", "version": variant},
    }
    before = len(_runs(dag_id))
    with caplog.at_level(logging.INFO):
        # the created event carries the tags; the alias event's are read from the registry
        for event in (created, alias):
            r = _post(client, secret, event)
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "skipped", r.json()
            assert "GRAPHTRIM_ALLOW_VARIANT_SOURCE" in r.json()["reason"]
    assert len(_runs(dag_id)) == before
    assert len(_skips(caplog, name, variant)) == 2  # one line per skipped event
    assert "GRAPHTRIM_ALLOW_VARIANT_SOURCE=true to optimize it" in _skips(caplog, name, variant)[0]
    # an alias on a source version triggers as before, the run the registry events would start
    r = _post(client, secret, {**alias, "data": {**alias["data"], "version": source}})
    assert r.json()["status"] == "triggered", r.json()
    ctx = StageContext(tracking, ".")
    assert r.json()["run_id"] == conf_for(ctx, name, source)["run_id"]
    assert r.json()["conf"] == conf_for(ctx, name, source)["conf"]
    # allowed (argument or $GRAPHTRIM_ALLOW_VARIANT_SOURCE): the run takes the variant on purpose
    monkeypatch.setenv("GRAPHTRIM_ALLOW_VARIANT_SOURCE", "true")
    allowed = TestClient(create_app(secret=secret, dag_id=dag_id))
    r = _post(allowed, secret, created)
    assert r.json()["status"] == "triggered", r.json()
    run = [x for x in _runs(dag_id) if x.run_id == r.json()["run_id"]]
    assert run[0].conf == {**conf_for(ctx, name, variant)["conf"], "allow_variant_source": True}
    assert len(_runs(dag_id)) == before + 2


def test_webhook_cannot_read_the_tags_so_mlflow_delivers_again(
    serialized_dags: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from graphtrim.airflow.plugin import create_app
    from tests.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_DEAD", json.dumps({"conn_type": "graphtrim_mlflow", "host": dead})
    )
    monkeypatch.setenv("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", "mlflow_dead")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.delenv("GRAPHTRIM_ALLOW_VARIANT_SOURCE", raising=False)
    dag_id = "graphtrim_optimize_model"
    client = TestClient(create_app(secret="s", dag_id=dag_id))
    alias = {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {"name": "digits", "alias": "champion", "version": "3"},
    }
    before = len(_runs(dag_id))
    delivery = uuid.uuid4().hex
    r = _post(client, "s", alias, delivery=delivery)
    assert r.status_code == 503, r.text  # MLflow retries 5xx deliveries
    assert len(_runs(dag_id)) == before
    # the same delivery again is not taken for a duplicate: it is judged again
    assert _post(client, "s", alias, delivery=delivery).status_code == 503


def test_webhook_without_a_secret_refuses_everything() -> None:
    from fastapi.testclient import TestClient

    from graphtrim.airflow.plugin import create_app

    calls: list[Any] = []
    client = TestClient(create_app(secret="", trigger=lambda *a: calls.append(a) or "x"))
    assert _post(client, "", {"entity": "model_version", "action": "created"}).status_code == 503
    assert calls == []


def test_plugin_is_discovered_by_airflow() -> None:
    code = (
        "from airflow import plugins_manager as pm; apps, _ = pm.get_fastapi_plugins(); "
        "print([a['url_prefix'] for a in apps])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert "/graphtrim" in out.stdout, out.stdout + out.stderr[-2000:]


# ---------------------------------------------------------------------------- scan


def test_registry_scan_finds_versions_without_variants(
    servers: dict[str, str], digits_task: DigitsTask, tmp_path: Path
) -> None:
    from graphtrim.stages import pipeline
    from graphtrim.stages.context import PipelineConfig, StageContext
    from graphtrim.stages.scan import unoptimized_versions

    name = f"scanned-{uuid.uuid4().hex[:6]}"
    tags = {
        "graphtrim.optimize": "true",
        "graphtrim.variants": "graph",
        "graphtrim.eval_data": str(digits_task.eval),
    }
    v1 = register_onnx(servers["mlflow"], digits_task.model, name, **tags)
    ctx = StageContext(servers["mlflow"], str(tmp_path / "artifacts"))

    def mine() -> list[dict[str, Any]]:
        return [f for f in unoptimized_versions(ctx, limit=100) if f["conf"]["model_name"] == name]

    config = PipelineConfig(variants=("graph",), eval_data=str(digits_task.eval)).resolved(ctx)
    assert mine() == [
        {
            "conf": {
                "model_name": name,
                "version": v1,
                "variants": ["graph"],
                "eval_data": str(digits_task.eval),
            },
            # the idempotency key of this work: same version, same config, same run id
            "run_id": f"graphtrim__{name}__v{v1}__{config.config_hash[:16]}",
        }
    ]
    # optimized with that config: done (even if its variant had failed a gate)
    pipeline.run_pipeline(ctx, config, f"models:/{name}/{v1}")
    assert mine() == []
    # a new source version is found; the variants graphtrim registered are not sources
    v_new = register_onnx(servers["mlflow"], digits_task.model, name)
    assert [f["conf"]["version"] for f in mine()] == [v_new]
    assert unoptimized_versions(ctx, limit=1) and len(unoptimized_versions(ctx, limit=1)) == 1


def _watched_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """An embedded registry, the Airflow hooks' fallback without a connection: two versions of a
    watched model (``watched``) and one of a model nobody watches. (tracking URI, versions)"""
    from tests.helpers import tiny_onnx

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    model = tiny_onnx(tmp_path / "m.onnx")
    mlruns = tmp_path / "mlruns"
    tags = {"graphtrim.optimize": "true", "graphtrim.variants": "graph"}
    versions = [register_onnx(tracking, model, "watched", artifact_dir=mlruns, **tags)]
    versions.append(register_onnx(tracking, model, "watched", artifact_dir=mlruns))
    register_onnx(tracking, model, "unwatched", artifact_dir=mlruns)
    return tracking, versions


def test_registry_scan_operator_hands_the_scan_to_the_trigger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from graphtrim.airflow.registry import RegistryScanOperator
    from graphtrim.stages.context import StageContext
    from graphtrim.stages.scan import unoptimized_versions

    tracking, (v1, v2) = _watched_models(tmp_path, monkeypatch)
    scan = unoptimized_versions(StageContext(tracking, "."), versions_per_model=2)
    assert [f["conf"]["version"] for f in scan] == [v2, v1]
    # rendered from the DAG's params, every argument arrives as text
    op = RegistryScanOperator(
        task_id="candidates",
        max_runs="10",
        versions_per_model="2",
        watch_tag="graphtrim.optimize",
        artifacts="",
        allow_variant_source="False",
    )
    assert op.execute({}) == [{"conf": f["conf"], "trigger_run_id": f["run_id"]} for f in scan]
    # an artifact store goes into each run's conf; max_runs caps the fan-out
    store = str(tmp_path / "artifacts")
    op = RegistryScanOperator(
        task_id="candidates", max_runs="1", versions_per_model="2", artifacts=store
    )
    assert op.execute({}) == [
        {"conf": {**scan[0]["conf"], "artifacts": store}, "trigger_run_id": scan[0]["run_id"]}
    ]
    # another watch tag: nothing to do
    op = RegistryScanOperator(task_id="candidates", watch_tag="graphtrim.other")
    assert op.execute({}) == []


def test_registry_events_operator_triggers_each_version_of_its_events_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime as dt

    from airflow.sdk.api.datamodels._generated import AssetReferenceAssetEventDagRun
    from airflow.sdk.execution_time.comms import AssetEventDagRunReferenceResult
    from airflow.sdk.execution_time.context import TriggeringAssetEventsAccessor

    from graphtrim.airflow.registry import RegistryEventsOperator
    from graphtrim.stages.context import StageContext
    from graphtrim.stages.scan import conf_for

    tracking, (v1, v2) = _watched_models(tmp_path, monkeypatch)

    def event(extra: dict[str, Any]) -> AssetEventDagRunReferenceResult:
        name = "graphtrim-mlflow-registry"
        return AssetEventDagRunReferenceResult(
            asset=AssetReferenceAssetEventDagRun(name=name, uri=name, extra={}),
            extra=extra,
            source_task_id=None,
            source_dag_id=None,
            source_run_id=None,
            source_map_index=None,
            source_aliases=[],
            timestamp=dt.datetime.now(dt.timezone.utc),
        )

    events = TriggeringAssetEventsAccessor.build(
        [
            # what AssetWatcher records: the trigger's payload under "payload"
            event({"payload": {"name": "watched", "version": v1, "model_uri": "m"}}),
            event({"name": "watched", "version": v1}),  # the same version again: one run
            event({"payload": {"name": "watched", "version": v2, "allow_variant_source": True}}),
            event({"payload": {"name": "watched"}}),  # no version: nothing to run
        ]
    )
    ctx = StageContext(tracking, ".")
    first, second = conf_for(ctx, "watched", v1), conf_for(ctx, "watched", v2)
    op = RegistryEventsOperator(task_id="versions")
    assert op.execute({"triggering_asset_events": events}) == [
        {"conf": first["conf"], "trigger_run_id": first["run_id"]},
        {
            "conf": {**second["conf"], "allow_variant_source": True},
            "trigger_run_id": second["run_id"],
        },
    ]
    assert op.execute({"triggering_asset_events": None}) == []


def test_webhook_and_registry_events_give_a_version_one_run(
    serialized_dags: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version that both the webhook and the registry events deliver is one optimize run: the
    webhook triggers the run id (and conf) that the events path computes for it, so whichever
    comes second is refused by Airflow's unique run id instead of optimizing it twice."""
    import types

    from fastapi.testclient import TestClient

    from graphtrim.airflow.plugin import create_app
    from graphtrim.airflow.registry import event_trigger_arguments
    from graphtrim.stages.context import StageContext

    tracking, (v1, _) = _watched_models(tmp_path, monkeypatch)
    # the webhook reads the registry through $MLFLOW_TRACKING_URI (no connection named)
    for name in ("AIRFLOW_CONN_MLFLOW_DEFAULT", "GRAPHTRIM_WEBHOOK_MLFLOW_CONN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GRAPHTRIM_ALLOW_VARIANT_SOURCE", raising=False)
    dag_id = "graphtrim_optimize_model"
    event = types.SimpleNamespace(extra={"payload": {"name": "watched", "version": v1}})
    [events_run] = event_trigger_arguments(StageContext(tracking, "."), {"registry": [event]})
    client = TestClient(create_app(secret="s", dag_id=dag_id))
    created = {
        "entity": "model_version",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {"name": "watched", "version": v1, "source": "models:/m-1", "tags": {}},
    }
    r = _post(client, "s", created)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "triggered", r.json()
    assert r.json()["run_id"] == events_run["trigger_run_id"]
    [run] = [x for x in _runs(dag_id) if x.run_id == events_run["trigger_run_id"]]
    assert run.conf == events_run["conf"]  # the model's graphtrim.* tags, as the events read them
    # another delivery of the same version (an alias event, a redelivery) starts nothing new
    again = _post(client, "s", created)
    assert again.json()["status"] == "duplicate", again.json()
    assert [x.run_id for x in _runs(dag_id) if x.conf.get("model_name") == "watched"] == [
        events_run["trigger_run_id"]
    ]


@pytest.mark.timeout(1800)  # only against a hang: four pipeline runs on a busy machine
def test_registry_scan_passes_over_variants_and_retries_runs_that_did_not_finish(
    servers: dict[str, str],
    digits_task: DigitsTask,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from graphtrim.stages import pipeline
    from graphtrim.stages.context import PipelineConfig, StageContext
    from graphtrim.stages.scan import run_key, unoptimized_versions

    tracking = servers["mlflow"]
    name = f"rescanned-{uuid.uuid4().hex[:6]}"
    tags = {
        "graphtrim.optimize": "true",
        "graphtrim.variants": "graph",
        "graphtrim.eval_data": str(digits_task.eval),
    }
    finished = register_onnx(tracking, digits_task.model, name, **tags)
    failed, crashed, running = (register_onnx(tracking, digits_task.model, name) for _ in "abc")
    ctx = StageContext(tracking, str(tmp_path / "artifacts"))
    config = PipelineConfig(variants=("graph",), eval_data=str(digits_task.eval)).resolved(ctx)

    def key(version: str, attempt: int = 0) -> str:
        return run_key(name, version, config.config_hash, attempt)

    # FINISHED: a whole pipeline run
    pipeline.run_pipeline(ctx, config, f"models:/{name}/{finished}")
    # RUNNING and alive: exported, the next stage not started yet
    pipeline.export(ctx, config, f"models:/{name}/{running}")
    # FAILED: the optimize stage cannot read its input
    exported = pipeline.export(ctx, config, f"models:/{name}/{failed}")
    broken = {**exported, "model": {**exported["model"], "uri": str(tmp_path / "gone.onnx")}}
    with pytest.raises(Exception):  # noqa: B017 - whatever the stage raises, the run FAILED
        pipeline.optimize(ctx, config, broken)
    # RUNNING for ever: the process died inside the optimize stage (SIGKILL, like a crash)
    args = [tracking, str(tmp_path / "artifacts"), name, crashed, str(digits_task.eval)]
    child = subprocess.run(
        [sys.executable, "-c", _DIE_IN_OPTIMIZE, *args],
        capture_output=True,
        text=True,
        timeout=900,  # only against a hang
    )
    assert child.returncode == -9, child.stderr[-3000:]
    variant = _register_variant(tracking, name, finished, "int8-static")

    def mine(**kw: Any) -> dict[str, Any]:
        found = unoptimized_versions(ctx, limit=100, versions_per_model=10, **kw)
        return {f["conf"]["version"]: f for f in found if f["conf"]["model_name"] == name}

    with caplog.at_level(logging.INFO, logger="graphtrim.scan"):
        found = mine()
    # retried under a new run id (the first one exists in Airflow already)
    assert {v: f["run_id"] for v, f in found.items()} == {
        failed: key(failed, 1),
        crashed: key(crashed, 1),
    }
    assert _skips(caplog, name, variant) == [
        f"skipping {name} v{variant}: a graphtrim variant (graphtrim.variant=int8-static); "
        "allow_variant_source=True to optimize it"
    ]
    # a RUNNING run older than the staleness is taken for abandoned too
    assert set(mine(stale_after=0)) == {failed, crashed, running}
    # asked for explicitly, the variant is a source, and its conf says so
    allowed = mine(allow_variant_source=True)
    assert allowed[variant]["conf"]["allow_variant_source"] is True
    assert allowed[variant]["run_id"] == key(variant)
    assert "allow_variant_source" not in allowed[failed]["conf"]


_DIE_IN_OPTIMIZE = """
import os, signal, sys
from graphtrim.stages import pipeline
from graphtrim.stages.context import PipelineConfig, StageContext

tracking, artifacts, name, version, eval_data = sys.argv[1:]

def progress(line):
    if line == "optimize: started":
        os.kill(os.getpid(), signal.SIGKILL)

ctx = StageContext(tracking, artifacts, progress=progress)
config = PipelineConfig(variants=("graph",), eval_data=eval_data).resolved(ctx)
pipeline.optimize(ctx, config, pipeline.export(ctx, config, f"models:/{name}/{version}"))
"""
