"""graphtrim: optimize one registered model version.

export -> optimize -> quantize[variant] -> gate[variant] -> register -> promote -> summary, each
its own task; one mapped quantize / gate pair per variant. With ``tune``, the settings search
runs before quantize in the task group ``tune``: a plan, then per round one mapped trial task
per trial on the device's workers (pool ``$GRAPHTRIM_TUNE_POOL``, on the GPU DAG the GPU pool
by default) and a select; without it those tasks end at once. The stage tasks are derived from the
pipeline's list of stages (``graphtrim.airflow.pipeline.stage_tasks``): a stage added there is a
task here. Two DAGs: ``graphtrim_optimize_model``
gates on CPU workers, ``graphtrim_optimize_model_gpu`` builds and gates variants on GPU workers
(Celery queue ``gpu``, a GPU pod on Kubernetes) under the ``graphtrim_gpu`` pool.

Trigger with ``conf``: ``{"model_name": "...", "version": "3"}`` (or ``"alias": "..."``), and
optionally ``variants``, ``preset``, ``opset``, ``policy`` (a gate policy document), ``calibration`` /
``eval_data`` (.npz URIs), ``target_name``, ``artifacts``, ``allow_variant_source`` (take a
version graphtrim registered, a variant, as the source; refused otherwise).

The register task emits an Asset event per version it creates (alias ``graphtrim-registered``)
and the promote task one per alias it moves (``graphtrim-promoted``), on the registered model's
asset ``x-mlflow://registered-models/<name>``: see ``graphtrim.airflow.assets``. Each stage task
links its MLflow run, the version it registered and its report (extra links).

Every task has an ``execution_timeout`` (per stage; ``$GRAPHTRIM_TASK_TIMEOUT_MINUTES`` and
``$GRAPHTRIM_TASK_TIMEOUT_MINUTES_<STAGE>`` override it when the DAG is parsed: see
``graphtrim.airflow.timeouts``).
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.sdk import DAG, Param, task

from graphtrim.airflow.params import dag_params
from graphtrim.airflow.pipeline import stage_tasks
from graphtrim.airflow.run_plan import plan_run, variant_table
from graphtrim.airflow.timeouts import task_timeout

GPU_POOL = os.environ.get("GRAPHTRIM_GPU_POOL", "graphtrim_gpu")
# the settings search's trial tasks (a ``tune`` run): on the CPU DAG Airflow's default pool
# unless named; on the GPU DAG the GPU pool unless named
TUNE_POOL = os.environ.get("GRAPHTRIM_TUNE_POOL") or None


def _params(device: str) -> dict[str, Param]:
    """The run parameters the DAGs take (the run-parameter table, ``graphtrim.run_params``)."""
    return {name: Param(default, **schema) for name, (default, schema) in dag_params(device)}


def optimize_dag(dag_id: str, device: str) -> DAG:
    with DAG(
        dag_id,
        description=f"graphtrim: export, optimize, build and gate variants ({device}), register",
        doc_md=__doc__,
        schedule=None,
        start_date=dt.datetime(2026, 1, 1),
        catchup=False,
        params=_params(device),
        default_args={
            "retries": 2,
            "retry_delay": dt.timedelta(seconds=20),
            "retry_exponential_backoff": 2.0,
        },
        max_active_runs=4,
        tags=["graphtrim"],
    ) as dag:

        @task(multiple_outputs=True, execution_timeout=task_timeout("plan"))
        def plan(params: dict[str, Any] | None = None) -> dict[str, Any]:
            """The source URI and the pipeline config from the run's params (checked here, so a
            bad request fails before any work)."""
            return plan_run(params, device)

        @task(execution_timeout=task_timeout("variants"))
        def variants(names: list[str]) -> list[str]:
            """The variants to map the quantize / gate pairs over."""
            return list(names)

        p: Any = plan()  # its keys are XComArgs of the plan task
        common: dict[str, Any] = {
            "config": p["config"],
            "artifacts": p["artifacts"],
            "allow_variant_source": p["allow_variant_source"],
            "rejudge": p["rejudge"],
            "force_promotion": p["force_promotion"],
        }
        # a task per stage of the pipeline (graphtrim.stages.STAGES), in its order
        stages = stage_tasks(
            model_uri=p["model_uri"],
            variants=variants(p["variants"]),
            common=common,
            device=device,
            pool=GPU_POOL if device == "gpu" else None,
            tune_pool=TUNE_POOL,
        )

        @task(execution_timeout=task_timeout("summary"))
        def summary(validated: Any, registered: Any, promoted: Any) -> str:
            """The variant table (gate verdicts, registered versions, aliases) as this task's
            XCom (Airflow logs it too)."""
            return variant_table(validated, registered, promoted)

        summary(stages["validate"].output, stages["register"].output, stages["promote"].output)
    return dag


cpu_dag = optimize_dag("graphtrim_optimize_model", "cpu")
gpu_dag = optimize_dag("graphtrim_optimize_model_gpu", "gpu")
