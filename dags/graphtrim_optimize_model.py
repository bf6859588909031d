"""graphtrim: optimize one registered model version.

export -> optimize -> quantize[variant] -> gate[variant] -> register -> promote -> summary, each
its own task; one mapped quantize / gate pair per variant. Two DAGs: ``graphtrim_optimize_model``
gates on CPU workers, ``graphtrim_optimize_model_gpu`` builds and gates variants on GPU workers
(Celery queue ``gpu``, a GPU pod on Kubernetes) under the ``graphtrim_gpu`` pool.

Trigger with ``conf``: ``{"model_name": "...", "version": "3"}`` (or ``"alias": "..."``), and
optionally ``variants``, ``preset``, ``policy`` (a gate policy document), ``calibration`` /
``eval_data`` (.npz URIs), ``target_name``, ``artifacts``, ``allow_variant_source`` (take a
version graphtrim registered, a variant, as the source; refused otherwise).

Every task has an ``execution_timeout`` (per stage; ``$GRAPHTRIM_TASK_TIMEOUT_MINUTES`` and
``$GRAPHTRIM_TASK_TIMEOUT_MINUTES_<STAGE>`` override it when the DAG is parsed: see
``operators.airflow.timeouts``).
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from airflow.sdk import DAG, Param, task

from operators.airflow.operators import (
    GraphOptimizeOperator,
    MlflowAliasPromoteOperator,
    MlflowModelExportOperator,
    MlflowVariantRegisterOperator,
    ModelGateOperator,
    ModelQuantizeOperator,
    placement,
    plan_run,
    variant_table,
)
from operators.airflow.timeouts import task_timeout

VARIANTS = ["graph", "int8-dynamic", "int8-static", "fp16"]
GPU_POOL = os.environ.get("GRAPHTRIM_GPU_POOL", "graphtrim_gpu")


def _params(device: str) -> dict[str, Param]:
    other = "graphtrim_optimize_model" if device == "gpu" else "graphtrim_optimize_model_gpu"
    return {
        # placement is fixed when the DAG is parsed (queue, pod), so each device has its own
        # DAG; a run asking this one for the other device is refused at trigger time
        "device": Param(
            device,
            type="string",
            enum=[device],
            description=f"where quantize and gate run; for the other device use {other}",
        ),
        "model_name": Param("", type="string", description="registered model to optimize"),
        "version": Param(None, type=["null", "string"], description="version (or use alias)"),
        "alias": Param(None, type=["null", "string"], description="alias, e.g. champion"),
        "variants": Param(
            ["graph", "int8-dynamic", "int8-static"],
            type="array",
            items={"type": "string", "enum": VARIANTS},
            description="variants to build",
        ),
        "preset": Param("default", type="string", enum=["default", "safe", "minimal"]),
        "policy": Param(None, type=["null", "object"], description="gate policy document"),
        "calibration": Param(None, type=["null", "string"], description=".npz calibration data"),
        "eval_data": Param(None, type=["null", "string"], description=".npz evaluation data"),
        "target_name": Param(None, type=["null", "string"], description="registered model to fill"),
        "artifacts": Param(
            os.environ.get("GRAPHTRIM_ARTIFACTS", ""),
            type="string",
            description="artifact store: s3://bucket/prefix or a folder",
        ),
        "allow_variant_source": Param(
            False,
            type="boolean",
            description="optimize a version graphtrim registered itself (a variant)",
        ),
        "rejudge": Param(
            False,
            type="boolean",
            description="build and measure again the variants judged before under this config",
        ),
        "force_promotion": Param(
            False,
            type="boolean",
            description="move the champion even where a person holds it (promote / rollback)",
        ),
    }


def optimize_dag(dag_id: str, device: str) -> DAG:
    # spelled out for the mapped tasks: their queue and pod are read before any operator exists
    placed: dict[str, Any] = {"device": device, **placement(device)}
    if device == "gpu":
        placed["pool"] = GPU_POOL
    with DAG(
        dag_id,
        description=f"graphtrim: export, optimize, build and gate variants ({device}), register",
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
        export = MlflowModelExportOperator(
            task_id="export",
            model_uri=p["model_uri"],
            execution_timeout=task_timeout("export"),
            **common,
        )
        optimize = GraphOptimizeOperator(
            task_id="optimize",
            exported=export.output,
            execution_timeout=task_timeout("optimize"),
            **common,
        )
        quantize = ModelQuantizeOperator.partial(
            task_id="quantize",
            execution_timeout=task_timeout("quantize"),
            exported=export.output,
            optimized=optimize.output,
            **common,
            **placed,
        ).expand(variant=variants(p["variants"]))
        gate = ModelGateOperator.partial(
            task_id="gate",
            execution_timeout=task_timeout("gate"),
            exported=export.output,
            **common,
            **placed,
        ).expand(quantized=quantize.output)
        register = MlflowVariantRegisterOperator(
            task_id="register",
            execution_timeout=task_timeout("register"),
            optimized=optimize.output,
            validated=gate.output,
            **common,
        )
        promote = MlflowAliasPromoteOperator(
            task_id="promote",
            execution_timeout=task_timeout("promote"),
            validated=gate.output,
            registered=register.output,
            **common,
        )

        @task(execution_timeout=task_timeout("summary"))
        def summary(validated: Any, registered: Any, promoted: Any) -> str:
            """The variant table (gate verdicts, registered versions, aliases) as this task's
            XCom (Airflow logs it too)."""
            return variant_table(validated, registered, promoted)

        summary(gate.output, register.output, promote.output)
    return dag


cpu_dag = optimize_dag("graphtrim_optimize_model", "cpu")
gpu_dag = optimize_dag("graphtrim_optimize_model_gpu", "gpu")
