"""graphtrim: find registered versions that still lack optimized variants, and optimize them.

Hourly, every registered model tagged ``graphtrim.optimize = true`` (``$GRAPHTRIM_WATCH_TAG``)
is checked: its newest ``versions_per_model`` versions that graphtrim did not produce (unless
``allow_variant_source``) and that have neither a variant registered nor a finished or live
pipeline run under the current config hash get one ``graphtrim_optimize_model`` run each, at
most ``max_runs`` per scan. A run that failed, was killed, or was left RUNNING by a dead process
(or for longer than ``$GRAPHTRIM_SCAN_STALE_HOURS``, 6) is retried under a new run id. Per-model settings come from the registered model's
tags ``graphtrim.variants`` (comma-separated), ``graphtrim.calibration`` and
``graphtrim.eval_data`` (.npz URIs). GPU work is capped by the optimize DAG's pool. Task
timeouts: ``operators.airflow.timeouts``.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param, task

from operators.airflow.timeouts import task_timeout

with DAG(
    "graphtrim_registry_scan",
    description="graphtrim: optimize registered versions that lack variants for the current config",
    schedule="@hourly",
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={
        "max_runs": Param(10, type="integer", minimum=1, description="fan-out cap per scan"),
        "versions_per_model": Param(1, type="integer", minimum=1),
        "watch_tag": Param(
            os.environ.get("GRAPHTRIM_WATCH_TAG", "graphtrim.optimize"), type="string"
        ),
        "artifacts": Param(os.environ.get("GRAPHTRIM_ARTIFACTS", ""), type="string"),
        "allow_variant_source": Param(
            os.environ.get("GRAPHTRIM_ALLOW_VARIANT_SOURCE", "").lower() in ("1", "true", "yes"),
            type="boolean",
            description="optimize versions graphtrim registered itself (variants) as sources",
        ),
    },
    default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=30)},
    tags=["graphtrim"],
) as dag:

    @task(execution_timeout=task_timeout("candidates"))
    def candidates(params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Trigger arguments (conf and run id) for each version that still needs a run."""
        from operators.airflow.hooks import ArtifactStoreHook, MlflowRegistryHook
        from optimizer_core.stages.context import StageContext
        from optimizer_core.stages.scan import unoptimized_versions

        p = params or {}
        artifacts = p.get("artifacts") or None
        ctx = StageContext(
            tracking_uri=MlflowRegistryHook().tracking_uri(),
            artifacts=artifacts or ".",
            s3_endpoint_url=ArtifactStoreHook().endpoint_url()
            if str(artifacts or "").startswith("s3://")
            else None,
            mlflow_auth=MlflowRegistryHook().auth(),
            s3_auth=ArtifactStoreHook().auth()
            if str(artifacts or "").startswith("s3://")
            else None,
        )
        found = unoptimized_versions(
            ctx,
            watch_tag=p["watch_tag"],
            versions_per_model=int(p["versions_per_model"]),
            limit=int(p["max_runs"]),
            allow_variant_source=bool(p.get("allow_variant_source")),
        )
        if artifacts:
            for item in found:
                item["conf"]["artifacts"] = artifacts
        # the run id is the work's idempotency key: a second scan (or an event) asking for the
        # same version and config is skipped by Airflow's unique run id, not by luck
        return [{"conf": f["conf"], "trigger_run_id": f["run_id"]} for f in found]

    TriggerDagRunOperator.partial(
        task_id="optimize",
        execution_timeout=task_timeout("trigger"),
        trigger_dag_id="graphtrim_optimize_model",
        skip_when_already_exists=True,
    ).expand_kwargs(candidates())
