"""An Airflow plugin that receives MLflow registry webhooks on the API server.

``POST /graphtrim/mlflow-webhook`` accepts MLflow's ``model_version.created`` and
``model_version_alias.created`` events and triggers the optimize DAG
(``$GRAPHTRIM_WEBHOOK_DAG``, default ``graphtrim_optimize_model``) with the version in ``conf``.

Every request must be signed as MLflow signs them: ``X-MLflow-Signature: v1,<base64
HMAC-SHA256>`` over ``<delivery id>.<timestamp>.<body>`` with the shared secret
(``$GRAPHTRIM_WEBHOOK_SECRET``). Unsigned or badly signed requests get 401, a timestamp outside
the window (``$GRAPHTRIM_WEBHOOK_MAX_AGE``, 300 s) or a malformed one 400; neither triggers
anything. A delivery id seen before is acknowledged and ignored: the DAG run's id is derived from
it, so even a replay that reaches another API server replica triggers nothing new.

Versions that graphtrim registered itself (its variants, tagged ``graphtrim.variant`` /
``graphtrim.key``) trigger nothing (``{"status": "skipped"}``, one log line), or every variant
would be optimized again as a new source. ``model_version.created`` carries the version's tags;
for an alias event they are read from the MLflow registry (connection
``$GRAPHTRIM_WEBHOOK_MLFLOW_CONN``, default ``mlflow_default``, else ``$MLFLOW_TRACKING_URI``),
and while it cannot be read the event gets 503 (MLflow delivers it again).
``$GRAPHTRIM_ALLOW_VARIANT_SOURCE=true`` lets variants through.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, HTTPException, Request
from starlette.concurrency import run_in_threadpool

logger = logging.getLogger("graphtrim.webhook")

EVENTS = {("model_version", "created"), ("model_version_alias", "created")}
TriggerFn = Callable[[str, str, dict[str, Any]], str]
TagsFn = Callable[[str, str], Mapping[str, str]]
ALLOW_ENV = "GRAPHTRIM_ALLOW_VARIANT_SOURCE"


class AlreadyTriggered(Exception):
    """A DAG run with this id exists: the delivery was handled before."""


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """MLflow's webhook signature of a payload."""
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def airflow_trigger(dag_id: str, run_id: str, conf: dict[str, Any]) -> str:
    """Create a DAG run in the metadata database (the API server's own access)."""
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagRunAlreadyExists
    from airflow.utils.types import DagRunTriggeredByType

    try:
        run = trigger_dag(
            dag_id, triggered_by=DagRunTriggeredByType.REST_API, run_id=run_id, conf=conf
        )
    except DagRunAlreadyExists as exc:
        raise AlreadyTriggered(run_id) from exc
    return str(run.run_id) if run is not None else run_id


def mlflow_version_tags(name: str, version: str) -> dict[str, str]:
    """A model version's tags, read from the MLflow registry."""
    from mlflow import MlflowClient

    from operators.airflow.hooks import MlflowRegistryHook

    conn = os.environ.get("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", MlflowRegistryHook.default_conn_name)
    uri = MlflowRegistryHook(conn).tracking_uri()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return dict(client.get_model_version(name, str(version)).tags or {})


def _truthy(value: str | None) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def conf_for(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The optimize DAG's conf for a webhook payload, or None for events it does not handle."""
    if (payload.get("entity"), payload.get("action")) not in EVENTS:
        return None
    data = payload.get("data") or {}
    name, version = data.get("name"), data.get("version")
    if not name or not version:
        return None
    return {"model_name": str(name), "version": str(version)}


def create_app(
    *,
    secret: str | None = None,
    dag_id: str | None = None,
    trigger: TriggerFn | None = None,
    max_age: float | None = None,
    clock: Callable[[], float] = time.time,
    allow_variant_source: bool | None = None,
    version_tags: TagsFn | None = None,
) -> FastAPI:
    """The webhook receiver. Arguments left out come from the environment (see the module);
    ``version_tags`` reads a version's tags when the event does not carry them."""
    secret = secret if secret is not None else os.environ.get("GRAPHTRIM_WEBHOOK_SECRET")
    allow = (
        allow_variant_source
        if allow_variant_source is not None
        else _truthy(os.environ.get(ALLOW_ENV))
    )
    tags_of = version_tags or mlflow_version_tags
    dag = dag_id or os.environ.get("GRAPHTRIM_WEBHOOK_DAG", "graphtrim_optimize_model")
    window = (
        max_age
        if max_age is not None
        else float(os.environ.get("GRAPHTRIM_WEBHOOK_MAX_AGE", "300"))
    )
    fire = trigger or airflow_trigger
    seen: collections.OrderedDict[str, str] = collections.OrderedDict()
    app = FastAPI(title="graphtrim MLflow webhooks")

    async def _variant_skip(payload: dict[str, Any], conf: dict[str, Any]) -> str | None:
        """Why the event's version is not optimized (a graphtrim variant), or None."""
        from optimizer_core.stages.scan import variant_skip_message

        name, version = conf["model_name"], conf["version"]
        tags = (payload.get("data") or {}).get("tags")
        if not isinstance(tags, dict):  # an alias event: ask the registry
            try:
                tags = dict(await run_in_threadpool(tags_of, name, version))
            except Exception as exc:
                logger.warning("cannot read the tags of %s v%s: %s", name, version, exc)
                raise HTTPException(
                    503, f"cannot tell whether {name} v{version} is a graphtrim variant"
                ) from exc
        return variant_skip_message(name, version, tags, switch=f"{ALLOW_ENV}=true")

    @app.post("/mlflow-webhook")
    async def receive(request: Request) -> dict[str, Any]:
        if not secret:
            raise HTTPException(503, "webhook secret not configured (GRAPHTRIM_WEBHOOK_SECRET)")
        body = await request.body()
        delivery = request.headers.get("x-mlflow-delivery-id", "")
        stamp = request.headers.get("x-mlflow-timestamp", "")
        signature = request.headers.get("x-mlflow-signature", "")
        if not (delivery and stamp and signature):
            raise HTTPException(401, "unsigned request")
        if not hmac.compare_digest(signature, sign(secret, delivery, stamp, body)):
            raise HTTPException(401, "bad signature")
        try:
            age = abs(clock() - float(stamp))
        except ValueError as exc:
            raise HTTPException(400, "malformed timestamp") from exc
        if age > window:
            raise HTTPException(400, f"stale request ({age:.0f} s old, window {window:.0f} s)")
        if delivery in seen:
            return {"status": "duplicate", "run_id": seen[delivery]}
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise HTTPException(400, "body is not JSON") from exc
        conf = conf_for(payload) if isinstance(payload, dict) else None
        if conf is None:
            return {"status": "ignored"}
        if allow:
            conf["allow_variant_source"] = True
        else:
            skip = await _variant_skip(payload, conf)
            if skip is not None:
                logger.info(skip)
                return {"status": "skipped", "reason": skip}
        run_id = f"mlflow_webhook__{delivery}"
        try:
            run_id = fire(dag, run_id, conf)
            status = "triggered"
        except AlreadyTriggered:
            status = "duplicate"
        seen[delivery] = run_id
        while len(seen) > 10_000:
            seen.popitem(last=False)
        logger.info("%s %s for %s", status, run_id, conf)
        return {"status": status, "run_id": run_id, "dag_id": dag, "conf": conf}

    return app


class GraphtrimPlugin(AirflowPlugin):
    name = "graphtrim"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/graphtrim", "name": "graphtrim webhooks"}]
