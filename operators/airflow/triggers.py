"""Triggers on the MLflow registry, polled from Airflow's triggerer.

- :class:`MlflowModelVersionTrigger` waits for one version or alias to exist (the deferrable
  sensor's trigger).
- :class:`MlflowNewModelVersionTrigger` is an event trigger for ``AssetWatcher``: it fires once
  per new version of the registered models it watches. What it has seen is kept on each
  registered model as a watermark tag (``graphtrim.watermark.<watcher>`` = the highest version
  already fired), so a restarted triggerer never fires a version twice. (MLflow tags have no
  compare-and-set: two triggerers running the same watcher could both claim a version; the
  optimize DAG's lineage keys still register it once.)
  The watermark moves before the event is yielded: a crash in between loses that event rather
  than repeating it (the scheduled registry scan picks such a version up).
  Versions graphtrim registered itself (its variants, tagged ``graphtrim.variant`` /
  ``graphtrim.key``) fire nothing, or each variant would be optimized as a new source: the
  watermark moves past them with one log line each (``allow_variant_source=True`` fires them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent
from graphtrim.redact import redact

WATERMARK = "graphtrim.watermark."

logger = logging.getLogger("graphtrim.triggers")


def _connect(tracking_uri: str | None, conn_id: str | None) -> tuple[str, Any]:
    """(the tracking URI as logs may show it, a client with the connection's own credentials).
    The credentials are read from the connection here, in the triggerer, each time a trigger
    starts: they are never part of the trigger's serialized arguments, and never in the
    process's environment, which every other trigger of this triggerer shares."""
    from graphtrim.integrations.registry import mlflow_client
    from graphtrim.redact import redact

    if tracking_uri:
        return redact(tracking_uri), mlflow_client(tracking_uri)
    from graphtrim.airflow.hooks import MlflowRegistryHook

    hook = MlflowRegistryHook(conn_id or MlflowRegistryHook.default_conn_name)
    uri = hook.tracking_uri()
    return redact(uri), mlflow_client(uri, hook.auth())


def find_version(client: Any, name: str, version: str | None, alias: str | None) -> str | None:
    """The version ``models:/name/version`` or ``models:/name@alias`` names, once it is READY."""
    from mlflow.exceptions import MlflowException

    try:
        if alias:
            mv = client.get_model_version_by_alias(name, alias)
        else:
            mv = client.get_model_version(name, str(version))
    except MlflowException:
        return None
    status = str(getattr(mv, "status", "READY") or "READY")
    return str(mv.version) if status.endswith("READY") else None


class MlflowModelVersionTrigger(BaseTrigger):
    """Fires ``{"status": "found", "name", "version"}`` once the version / alias exists, or
    ``{"status": "timeout"}`` after ``timeout`` seconds."""

    def __init__(
        self,
        *,
        name: str,
        version: str | None = None,
        alias: str | None = None,
        tracking_uri: str | None = None,
        mlflow_conn_id: str | None = None,
        poll_interval: float = 30.0,
        timeout: float | None = None,
        started: float | None = None,
    ):
        super().__init__()
        self.name = name
        self.version = version
        self.alias = alias
        self.tracking_uri = tracking_uri
        self.mlflow_conn_id = mlflow_conn_id
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.started = started if started is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__name__}",
            {
                "name": self.name,
                "version": self.version,
                "alias": self.alias,
                "tracking_uri": self.tracking_uri,
                "mlflow_conn_id": self.mlflow_conn_id,
                "poll_interval": self.poll_interval,
                "timeout": self.timeout,
                "started": self.started,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        uri, client = await asyncio.to_thread(_connect, self.tracking_uri, self.mlflow_conn_id)
        while True:
            try:
                found = await asyncio.to_thread(
                    find_version, client, self.name, self.version, self.alias
                )
            except Exception as exc:  # the registry is down: keep polling, say so
                self.log.warning("polling %s: %s", uri, redact(exc))
                found = None
            if found is not None:
                yield TriggerEvent({"status": "found", "name": self.name, "version": found})
                return
            if self.timeout is not None and time.time() - self.started > self.timeout:
                yield TriggerEvent({"status": "timeout", "name": self.name})
                return
            await asyncio.sleep(self.poll_interval)


def new_versions(client: Any, watcher: str, *, watch_tag: str | None) -> list[dict[str, Any]]:
    """Versions newer than each watched model's watermark, oldest first, each with its tags
    (``name``, ``version``, ``tags``). A model seen for the first time gets its watermark at its
    latest version: what existed before is not new."""
    key = WATERMARK + watcher
    filter_string = f"tags.`{watch_tag}` = 'true'" if watch_tag else None
    out: list[dict[str, Any]] = []
    for rm in client.search_registered_models(filter_string=filter_string):
        versions = sorted(
            (
                (int(v.version), dict(v.tags or {}))
                for v in client.search_model_versions(f"name='{rm.name}'")
                if str(getattr(v, "status", "READY")).endswith("READY")
            ),
            key=lambda item: item[0],
        )
        tags = dict(rm.tags or {})
        if key not in tags:
            client.set_registered_model_tag(rm.name, key, str(versions[-1][0] if versions else 0))
            continue
        seen = int(tags[key])
        out += [
            {"name": rm.name, "version": str(v), "tags": vtags} for v, vtags in versions if v > seen
        ]
    return out


class MlflowNewModelVersionTrigger(BaseEventTrigger):
    """Fires ``{"name", "version", "model_uri"}`` once per new version of every registered
    model tagged ``watch_tag = true`` (every model when ``watch_tag`` is None). Versions that
    graphtrim registered (its variants) are passed over unless ``allow_variant_source``; then
    their events carry ``"allow_variant_source": True``."""

    def __init__(
        self,
        *,
        watcher: str = "graphtrim",
        watch_tag: str | None = "graphtrim.optimize",
        tracking_uri: str | None = None,
        mlflow_conn_id: str | None = None,
        poll_interval: float = 60.0,
        allow_variant_source: bool = False,
    ):
        super().__init__()
        self.watcher = watcher
        self.watch_tag = watch_tag
        self.tracking_uri = tracking_uri
        self.mlflow_conn_id = mlflow_conn_id
        self.poll_interval = poll_interval
        self.allow_variant_source = bool(allow_variant_source)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__name__}",
            {
                "watcher": self.watcher,
                "watch_tag": self.watch_tag,
                "tracking_uri": self.tracking_uri,
                "mlflow_conn_id": self.mlflow_conn_id,
                "poll_interval": self.poll_interval,
                "allow_variant_source": self.allow_variant_source,
            },
        )

    def _claim(self, client: Any) -> dict[str, Any] | None:
        from graphtrim.stages.scan import variant_skip_message

        for item in new_versions(client, self.watcher, watch_tag=self.watch_tag):
            name, version = item["name"], item["version"]
            # at most once: the watermark moves before the event leaves (or past a skipped
            # version, so that it is skipped, and said, once)
            client.set_registered_model_tag(name, WATERMARK + self.watcher, version)
            skip = variant_skip_message(
                name, version, item["tags"], switch="allow_variant_source=True"
            )
            if skip is None:
                return {"name": name, "version": version, "model_uri": f"models:/{name}/{version}"}
            if self.allow_variant_source:
                return {
                    "name": name,
                    "version": version,
                    "model_uri": f"models:/{name}/{version}",
                    "allow_variant_source": True,
                }
            logger.info(skip)
        return None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        client = None
        while True:
            event = None
            try:
                if client is None:  # resolved in the loop: a missing connection is retried
                    _, client = await asyncio.to_thread(
                        _connect, self.tracking_uri, self.mlflow_conn_id
                    )
                event = await asyncio.to_thread(self._claim, client)
            except Exception as exc:
                self.log.warning("polling the MLflow registry: %s", redact(exc))
            if event is not None:
                yield TriggerEvent(event)
                continue  # more may be pending: no sleep between them
            await asyncio.sleep(self.poll_interval)
