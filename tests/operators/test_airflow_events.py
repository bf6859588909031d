"""Registry events: the new-version trigger, the deferrable sensor, the webhook endpoint and the
registry scan, against a real MLflow server and a real Airflow metadata database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from optimizer_core.examples.digits import DigitsTask
from tests.servers import register_onnx

pytestmark = [pytest.mark.xdist_group("mlflow"), pytest.mark.slow]


async def _events(trigger: Any, wait: float) -> list[dict[str, Any]]:
    """Every event the trigger yields within ``wait`` seconds."""
    out: list[dict[str, Any]] = []

    async def collect() -> None:
        async for event in trigger.run():
            out.append(event.payload)

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(collect(), timeout=wait)
    return out


def test_new_version_trigger_fires_once_per_version(
    servers: dict[str, str], digits_task: DigitsTask
) -> None:
    from operators.airflow.triggers import MlflowNewModelVersionTrigger

    name = f"watched-{uuid.uuid4().hex[:6]}"
    register_onnx(servers["mlflow"], digits_task.model, name, **{"graphtrim.optimize": "true"})
    register_onnx(servers["mlflow"], digits_task.model, f"{name}-unwatched")

    def trigger() -> MlflowNewModelVersionTrigger:
        return MlflowNewModelVersionTrigger(
            watcher="test", tracking_uri=servers["mlflow"], poll_interval=0.2
        )

    # first sight: what exists is not new
    assert [e for e in asyncio.run(_events(trigger(), 3)) if e["name"] == name] == []
    v2 = register_onnx(servers["mlflow"], digits_task.model, name)
    register_onnx(servers["mlflow"], digits_task.model, f"{name}-unwatched")
    fired = [e for e in asyncio.run(_events(trigger(), 4)) if e["name"].startswith(name)]
    assert fired == [{"name": name, "version": v2, "model_uri": f"models:/{name}/{v2}"}]
    # a restarted trigger (new instance, same watcher) does not fire it again
    assert [e for e in asyncio.run(_events(trigger(), 3)) if e["name"] == name] == []
    # a serialized round trip (what the triggerer stores) keeps the arguments
    path, kwargs = trigger().serialize()
    assert path == "operators.airflow.triggers.MlflowNewModelVersionTrigger"
    assert kwargs["watcher"] == "test" and kwargs["tracking_uri"] == servers["mlflow"]


def test_sensor_defers_then_completes(
    servers: dict[str, str], digits_task: DigitsTask, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.exceptions import TaskDeferred

    from operators.airflow.sensors import MlflowModelVersionSensor
    from operators.airflow.triggers import MlflowModelVersionTrigger
    from optimizer_core.errors import GraphtrimError

    monkeypatch.setenv(
        "AIRFLOW_CONN_MLFLOW_DEFAULT",
        json.dumps({"conn_type": "graphtrim_mlflow", "host": servers["mlflow"]}),
    )
    name = f"sensed-{uuid.uuid4().hex[:6]}"
    register_onnx(servers["mlflow"], digits_task.model, name)
    sensor = MlflowModelVersionSensor(task_id="wait", model_name=name, version="2", timeout=60)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trig = deferred.value.trigger
    assert isinstance(trig, MlflowModelVersionTrigger)
    trig.poll_interval = 0.2
    assert asyncio.run(_events(trig, 1.5)) == []  # version 2 does not exist yet
    register_onnx(servers["mlflow"], digits_task.model, name)
    events = asyncio.run(_events(trig, 10))
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
    from operators.airflow.plugin import sign

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

    from operators.airflow.plugin import create_app

    secret = "s3cret"
    dag_id = "graphtrim_optimize_model"
    client = TestClient(create_app(secret=secret, dag_id=dag_id))
    event = {
        "entity": "model_version",
        "action": "created",
        "timestamp": int(time.time()),
        "data": {"name": "digits", "version": "7", "source": "models:/m-1", "run_id": "r"},
    }
    before = len(_runs(dag_id))
    delivery = uuid.uuid4().hex
    ok = _post(client, secret, event, delivery=delivery)
    assert ok.status_code == 200, ok.text
    assert ok.json()["status"] == "triggered"
    runs = [r for r in _runs(dag_id) if r.run_id == f"mlflow_webhook__{delivery}"]
    assert len(runs) == 1
    assert runs[0].conf == {"model_name": "digits", "version": "7"}

    # replayed delivery id: acknowledged, nothing new (also from a fresh app: the run id is durable)
    assert _post(client, secret, event, delivery=delivery).json()["status"] == "duplicate"
    fresh = TestClient(create_app(secret=secret, dag_id=dag_id))
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


def test_webhook_without_a_secret_refuses_everything() -> None:
    from fastapi.testclient import TestClient

    from operators.airflow.plugin import create_app

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
    from optimizer_core.stages import pipeline
    from optimizer_core.stages.context import PipelineConfig, StageContext
    from optimizer_core.stages.scan import unoptimized_versions

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
