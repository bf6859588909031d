"""An Airflow plugin that receives MLflow registry webhooks on the API server.

``POST /graphtrim/mlflow-webhook`` accepts MLflow's ``model_version.created`` and
``model_version_alias.created`` events and triggers the optimize DAG
(``$GRAPHTRIM_WEBHOOK_DAG``, default ``graphtrim_optimize_model``) for the version, with the conf
and the run id that the registry events and the registry scan give the same work
(``graphtrim.stages.scan.conf_for``: the registered model's ``graphtrim.*`` tags, and the
run id ``run_key``). Whichever of them sees a version first starts its run; the others are
refused by Airflow's unique run id, so a version is never optimized twice. While the registry
cannot be read the event gets 503 (MLflow delivers it again).

Every request must be signed as MLflow signs them: ``X-MLflow-Signature: v1,<base64
HMAC-SHA256>`` over ``<delivery id>.<timestamp>.<body>`` with the shared secret
(``$GRAPHTRIM_WEBHOOK_SECRET``). The headers are judged before a byte of the body is read: a
missing or malformed signature gets 401; a timestamp that is not whole Unix seconds, or lies
outside the window (``$GRAPHTRIM_WEBHOOK_MAX_AGE``, 300 s), or a delivery id other than 1 to 128
of ``A-Z a-z 0-9 . _ -`` (and no ``..``) gets 400. The body is then read in chunks into the HMAC,
at most ``$GRAPHTRIM_WEBHOOK_MAX_BYTES`` (1 MiB; MLflow's events are a few hundred bytes): a
larger ``Content-Length``, or a body that grows past it, gets 413 and is not read further. A
signature that does not match gets 401. None of these triggers anything. A delivery id seen before
is acknowledged and ignored; a replay that reaches another API server replica triggers nothing
new either (the run id is the version's).

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
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request

from airflow.plugins_manager import AirflowPlugin
from graphtrim.errors import GraphtrimError
from graphtrim.redact import redact

logger = logging.getLogger("graphtrim.webhook")

EVENTS = {("model_version", "created"), ("model_version_alias", "created")}
TriggerFn = Callable[[str, str, dict[str, Any]], str]
TagsFn = Callable[[str, str], Mapping[str, str]]
RunFn = Callable[[str, str], Mapping[str, Any]]
ALLOW_ENV = "GRAPHTRIM_ALLOW_VARIANT_SOURCE"
MAX_BYTES_ENV = "GRAPHTRIM_WEBHOOK_MAX_BYTES"
MAX_AGE_ENV = "GRAPHTRIM_WEBHOOK_MAX_AGE"
DEFAULT_MAX_BYTES = 1024 * 1024

# what MLflow sends: a uuid4 delivery id, whole Unix seconds, one "v1," base64 HMAC-SHA256
_DELIVERY = re.compile(r"[A-Za-z0-9._-]{1,128}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SIGNATURE = re.compile(r"v1,[A-Za-z0-9+/]{43}=")


class AlreadyTriggered(Exception):
    """A DAG run with this id exists: the delivery was handled before."""


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """MLflow's webhook signature of a payload."""
    mac = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def airflow_trigger(dag_id: str, run_id: str, conf: dict[str, Any]) -> str:
    """Create a DAG run in the metadata database (the API server's own access)."""
    from sqlalchemy.exc import IntegrityError

    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagRunAlreadyExists
    from airflow.utils.types import DagRunTriggeredByType

    try:
        run = trigger_dag(
            dag_id, triggered_by=DagRunTriggeredByType.REST_API, run_id=run_id, conf=conf
        )
    except DagRunAlreadyExists as exc:
        raise AlreadyTriggered(run_id) from exc
    except IntegrityError as exc:  # created meanwhile by the registry events (or a replica)
        raise AlreadyTriggered(run_id) from exc
    return str(run.run_id) if run is not None else run_id


def mlflow_version_tags(name: str, version: str) -> dict[str, str]:
    """A model version's tags, read from the MLflow registry."""
    from graphtrim.airflow.hooks import MlflowRegistryHook

    conn = os.environ.get("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", MlflowRegistryHook.default_conn_name)
    client = MlflowRegistryHook(conn).get_client()  # the connection's token, in this client only
    return dict(client.get_model_version(name, str(version)).tags or {})


def registry_run(name: str, version: str) -> dict[str, Any]:
    """``{"conf", "run_id"}`` of the optimize run for a version, as the registry events and the
    registry scan compute them (:func:`graphtrim.stages.scan.conf_for`), through the webhook's
    MLflow connection; the S3 connection only where the model's tags name data files (their
    hashes are part of the config)."""
    from graphtrim.airflow.context import stage_context
    from graphtrim.airflow.hooks import MlflowRegistryHook
    from graphtrim.stages.context import DATA_KEYS
    from graphtrim.stages.scan import T, conf_for

    conn = os.environ.get("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", MlflowRegistryHook.default_conn_name)
    ctx = stage_context(".", mlflow_conn_id=conn, s3_connection=False)
    tags = dict(ctx.registry().client.get_registered_model(name).tags or {})
    if any(tags.get(T + key) for key in DATA_KEYS):
        ctx = stage_context(".", mlflow_conn_id=conn, s3_connection=True)
    return conf_for(ctx, name, version, tags)


def variants_page() -> str:
    """The graphtrim variants page: every variant in the registry of the webhook's MLflow
    connection, with links into MLflow's UI."""
    from graphtrim.airflow.hooks import MlflowRegistryHook
    from graphtrim.integrations.catalog import registered_variants, render_catalog
    from graphtrim.integrations.registry import Registry

    conn = os.environ.get("GRAPHTRIM_WEBHOOK_MLFLOW_CONN", MlflowRegistryHook.default_conn_name)
    hook = MlflowRegistryHook(conn)
    registry = Registry(hook.tracking_uri(), auth=hook.auth(), check=False)
    return render_catalog(
        registered_variants(registry), ui=hook.ui_url(), where=f"MLflow at {registry.where}"
    )


def _authenticated() -> Any:
    """Airflow's own check that the caller is signed in (the UI's session cookie or a bearer
    token): the page shows what the registry holds, so it is not public as the webhook is."""
    from airflow.api_fastapi.core_api.security import requires_authenticated

    return requires_authenticated()


AUTHENTICATED = _authenticated()


def _truthy(value: str | None) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def _setting(name: str, value: float | None, default: float, *, whole: bool = False) -> float:
    """A finite positive setting: the argument, else ``$name``, else ``default``."""
    raw: object = value
    if value is None:
        raw = os.environ.get(name, "").strip() or default
        try:
            value = int(str(raw)) if whole else float(str(raw))
        except ValueError:
            value = None
    if value is None or not math.isfinite(value) or value <= 0:
        kind = "whole number" if whole else "number"
        raise ValueError(f"{name} must be a positive {kind}, got {raw!r}")
    return value


def signed_headers(headers: Headers, now: float, window: float) -> tuple[str, str, str]:
    """The delivery id, timestamp and signature of a request, judged before its body is read.

    Raises:
        HTTPException: 401 for a missing or malformed signature, 400 for a malformed delivery id
            or timestamp, or one outside ``window`` seconds of ``now``.
    """
    delivery = headers.get("x-mlflow-delivery-id", "")
    stamp = headers.get("x-mlflow-timestamp", "")
    signature = headers.get("x-mlflow-signature", "")
    if not (delivery and stamp and signature):
        raise HTTPException(401, "unsigned request")
    # headers arrive as latin-1 text: anything outside the pattern (non-ASCII too) is refused
    # here, so the comparison below only ever sees ASCII
    if not _SIGNATURE.fullmatch(signature):
        raise HTTPException(401, "malformed signature")
    # the DAG run's id is built from it: no path-like or other surprising names
    if not _DELIVERY.fullmatch(delivery) or ".." in delivery:
        raise HTTPException(400, "malformed delivery id")
    if not _TIMESTAMP.fullmatch(stamp):
        raise HTTPException(400, "malformed timestamp (whole Unix seconds)")
    age = now - int(stamp)
    if not abs(age) <= window:
        side = "behind" if age > 0 else "ahead of"
        raise HTTPException(
            400,
            f"stale request: its timestamp is {abs(age):.0f} s {side} this server's clock "
            f"(window {window:.0f} s); when every delivery is refused so, the clocks of MLflow's "
            "server and this API server differ: synchronize them (NTP)",
        )
    return delivery, stamp, signature


async def signed_body(
    request: Request, secret: str, delivery: str, stamp: str, signature: str, limit: int
) -> bytes:
    """The request's body, read in chunks into the HMAC and never past ``limit`` bytes.

    Raises:
        HTTPException: 413 for a body (declared or read) over ``limit``, 400 for a malformed
            ``Content-Length``, 401 when the signature does not match.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not re.fullmatch(r"[0-9]{1,20}", declared):
            raise HTTPException(400, "malformed Content-Length")
        if int(declared) > limit:
            raise HTTPException(413, f"body over {limit} bytes ({MAX_BYTES_ENV})")
    mac = hmac.new(secret.encode(), f"{delivery}.{stamp}.".encode(), hashlib.sha256)
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:  # a chunked body, or one longer than it declared
            raise HTTPException(413, f"body over {limit} bytes ({MAX_BYTES_ENV})")
        mac.update(chunk)
        body += chunk
    expected = "v1," + base64.b64encode(mac.digest()).decode()
    if not hmac.compare_digest(signature.encode("ascii"), expected.encode("ascii")):
        raise HTTPException(401, "bad signature")
    return bytes(body)


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
    max_bytes: int | None = None,
    catalog: Callable[[], str] | None = None,
    run_for: RunFn | None = None,
) -> FastAPI:
    """The webhook receiver. Arguments left out come from the environment (see the module);
    ``version_tags`` reads a version's tags when the event does not carry them; ``run_for``
    gives a version's run conf and id (:func:`registry_run`);
    ``catalog`` renders ``GET /variants`` (signed-in callers only; :func:`variants_page`).

    Raises:
        ValueError: a window or body limit that is not a finite positive number.
    """
    secret = secret if secret is not None else os.environ.get("GRAPHTRIM_WEBHOOK_SECRET")
    allow = (
        allow_variant_source
        if allow_variant_source is not None
        else _truthy(os.environ.get(ALLOW_ENV))
    )
    tags_of = version_tags or mlflow_version_tags
    run_of = run_for or registry_run
    page_fn = catalog or variants_page
    dag = dag_id or os.environ.get("GRAPHTRIM_WEBHOOK_DAG", "graphtrim_optimize_model")
    window = _setting(MAX_AGE_ENV, max_age, 300.0)
    limit = int(_setting(MAX_BYTES_ENV, max_bytes, DEFAULT_MAX_BYTES, whole=True))
    fire = trigger or airflow_trigger
    seen: collections.OrderedDict[str, str] = collections.OrderedDict()
    app = FastAPI(title="graphtrim MLflow webhooks")

    async def _variant_skip(payload: dict[str, Any], conf: dict[str, Any]) -> str | None:
        """Why the event's version is not optimized (a graphtrim variant), or None."""
        from graphtrim.stages.scan import variant_skip_message

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
        delivery, stamp, signature = signed_headers(request.headers, clock(), window)
        body = await signed_body(request, secret, delivery, stamp, signature, limit)
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
        name, version = conf["model_name"], conf["version"]
        try:  # the work's own run id, shared with the registry events and scan
            found = await run_in_threadpool(run_of, name, version)
        except Exception as exc:
            logger.warning("cannot read the registry for %s v%s: %s", name, version, redact(exc))
            raise HTTPException(503, f"cannot read the registry for {name} v{version}") from exc
        conf = {**found["conf"], **conf}
        run_id = str(found["run_id"])
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

    @app.get("/variants", response_class=HTMLResponse, dependencies=[Depends(AUTHENTICATED)])
    async def variants() -> HTMLResponse:
        """Every graphtrim variant in the registry (a page of Airflow's UI, see the plugin)."""
        try:
            page = await run_in_threadpool(page_fn)
        except GraphtrimError as exc:
            raise HTTPException(503, f"cannot read the MLflow registry: {redact(exc)}") from exc
        return HTMLResponse(page)

    return app


class GraphtrimPlugin(AirflowPlugin):
    """The MLflow webhook receiver and the variants page (``/graphtrim/variants``), shown in
    the Airflow UI's navigation under Browse."""

    name = "graphtrim"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/graphtrim", "name": "graphtrim"}]
    external_views = [
        {
            "name": "graphtrim variants",
            "href": "/graphtrim/variants",
            "destination": "nav",
            "category": "browse",
            "url_route": "graphtrim-variants",
        }
    ]
