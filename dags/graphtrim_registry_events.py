"""graphtrim: optimize every new version of a watched registered model, as it appears.

Scheduled on an Asset fed by an ``AssetWatcher`` whose trigger polls the MLflow registry
(``MlflowNewModelVersionTrigger``): models tagged ``graphtrim.optimize = true`` (the tag is
``$GRAPHTRIM_WATCH_TAG``) fire one event per new version, and each event triggers one
``graphtrim_optimize_model`` run for it. Versions that graphtrim registered itself (its
variants) never fire: optimizing them would feed the loop (``$GRAPHTRIM_ALLOW_VARIANT_SOURCE``
= true lets them through). Task timeouts: ``graphtrim.airflow.timeouts``.
"""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import DAG, Asset, AssetWatcher

from graphtrim.airflow.params import env_flag
from graphtrim.airflow.registry import RegistryEventsOperator, optimize_each
from graphtrim.airflow.timeouts import task_timeout
from graphtrim.airflow.triggers import MlflowNewModelVersionTrigger

registry = Asset(
    "graphtrim-mlflow-registry",
    watchers=[
        AssetWatcher(
            name="graphtrim_new_model_versions",
            trigger=MlflowNewModelVersionTrigger(
                watcher="graphtrim_registry_events",
                watch_tag=os.environ.get("GRAPHTRIM_WATCH_TAG", "graphtrim.optimize"),
                mlflow_conn_id="mlflow_default",
                poll_interval=float(os.environ.get("GRAPHTRIM_WATCH_INTERVAL", "60")),
                allow_variant_source=env_flag(os.environ.get("GRAPHTRIM_ALLOW_VARIANT_SOURCE")),
            ),
        )
    ],
)

with DAG(
    "graphtrim_registry_events",
    description="graphtrim: one optimize run per new version of a watched registered model",
    doc_md=__doc__,
    schedule=[registry],
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=20)},
    tags=["graphtrim"],
) as dag:
    # one optimize run per version in the events that started this run, with the run id the
    # registry scan would use for the same work (so the two never both run it)
    versions = RegistryEventsOperator(
        task_id="versions", execution_timeout=task_timeout("versions")
    )

    optimize_each(versions.output)
