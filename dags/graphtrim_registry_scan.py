"""graphtrim: find registered versions that still lack optimized variants, and optimize them.

Hourly, every registered model tagged ``graphtrim.optimize = true`` (``$GRAPHTRIM_WATCH_TAG``)
is checked: its newest ``versions_per_model`` versions that graphtrim did not produce (unless
``allow_variant_source``) and that have neither a variant registered nor a finished or live
pipeline run under the current config hash get one ``graphtrim_optimize_model`` run each, at
most ``max_runs`` per scan. A run that failed, was killed, or was left RUNNING by a dead process
(or for longer than ``$GRAPHTRIM_SCAN_STALE_HOURS``, 6) is retried under a new run id. Per-model settings come from the registered model's
tags ``graphtrim.variants`` (comma-separated), ``graphtrim.calibration`` and
``graphtrim.eval_data`` (.npz URIs). GPU work is capped by the optimize DAG's pool. Task
timeouts: ``graphtrim.airflow.timeouts``.
"""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import DAG, Param

from graphtrim.airflow.params import env_flag
from graphtrim.airflow.registry import RegistryScanOperator, optimize_each
from graphtrim.airflow.timeouts import task_timeout

with DAG(
    "graphtrim_registry_scan",
    description="graphtrim: optimize registered versions that lack variants for the current config",
    doc_md=__doc__,
    schedule="@hourly",
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    params={
        "max_runs": Param(10, type="integer", minimum=1, description="fan-out cap per scan"),
        "versions_per_model": Param(
            1, type="integer", minimum=1, description="newest versions checked per model"
        ),
        "watch_tag": Param(
            os.environ.get("GRAPHTRIM_WATCH_TAG", "graphtrim.optimize"),
            type="string",
            description="registered-model tag (= true) that marks the models to optimize",
        ),
        "artifacts": Param(
            os.environ.get("GRAPHTRIM_ARTIFACTS", ""),
            type="string",
            description="artifact store for the runs: s3://bucket/prefix or a folder",
        ),
        "allow_variant_source": Param(
            env_flag(os.environ.get("GRAPHTRIM_ALLOW_VARIANT_SOURCE")),
            type="boolean",
            description="optimize versions graphtrim registered itself (variants) as sources",
        ),
    },
    default_args={"retries": 2, "retry_delay": dt.timedelta(seconds=30)},
    tags=["graphtrim"],
) as dag:
    candidates = RegistryScanOperator(
        task_id="candidates",
        execution_timeout=task_timeout("candidates"),
        max_runs="{{ params.max_runs }}",
        versions_per_model="{{ params.versions_per_model }}",
        watch_tag="{{ params.watch_tag }}",
        artifacts="{{ params.artifacts }}",
        allow_variant_source="{{ params.allow_variant_source }}",
    )

    optimize_each(candidates.output)
