"""The stage context of a task, built from Airflow connections in one place.

Every operator that calls ``optimizer_core`` hands it a :class:`StageContext`: the tracking URI
and credentials of an MLflow connection (:class:`MlflowRegistryHook`), the endpoint and key pair
of an S3 connection (:class:`ArtifactStoreHook`), and where the artifacts go. The credentials go
to the clients the context builds, never into ``os.environ`` (see ``graphtrim.airflow.hooks``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from graphtrim.airflow.hooks import ArtifactStoreHook, MlflowRegistryHook
from graphtrim.errors import GraphtrimError

if TYPE_CHECKING:
    from graphtrim.stages.context import StageContext

ARTIFACTS_ENV = "GRAPHTRIM_ARTIFACTS"


def artifact_store(artifacts: str | None, task_id: str) -> str:
    """Where a stage task keeps its artifacts: ``artifacts``, else ``$GRAPHTRIM_ARTIFACTS``; a
    task with neither fails with a message that says how to give one."""
    found = artifacts or os.environ.get(ARTIFACTS_ENV)
    if not found:
        raise GraphtrimError(
            f"{task_id}: no artifact store: pass artifacts= (s3://bucket/prefix or a "
            f"folder) or set ${ARTIFACTS_ENV}"
        )
    return str(found)


def stage_context(
    artifacts: str,
    *,
    mlflow_conn_id: str = MlflowRegistryHook.default_conn_name,
    aws_conn_id: str | None = ArtifactStoreHook.default_conn_name,
    s3_connection: bool | None = None,
    **fields: Any,
) -> StageContext:
    """A :class:`StageContext` on the connections ``mlflow_conn_id`` and ``aws_conn_id``.

    The S3 connection's endpoint and keys are used when ``s3_connection`` is true, or, when it
    is None, when the artifact store is on S3 (``s3://``): a task that reads no S3 object does
    not need the connection to exist. ``fields`` are the context's other fields (``workdir``,
    ``orchestrator_run_id``, ``progress``, ``worker``, ``allow_variant_source``, ...).
    """
    from graphtrim.stages.context import StageContext

    if s3_connection is None:
        s3_connection = str(artifacts).startswith("s3://")
    endpoint = s3_auth = None
    if s3_connection:
        s3_hook = ArtifactStoreHook(aws_conn_id)
        endpoint, s3_auth = s3_hook.endpoint_url(), s3_hook.auth()
    mlflow_hook = MlflowRegistryHook(mlflow_conn_id)
    return StageContext(
        tracking_uri=mlflow_hook.tracking_uri(),
        mlflow_auth=mlflow_hook.auth(),
        s3_auth=s3_auth,
        artifacts=str(artifacts),
        s3_endpoint_url=endpoint,
        **fields,
    )


def task_instance(context: Any) -> dict[str, Any] | None:
    """The task instance a stage runs as (recorded with the stage in its MLflow run), from the
    task's Airflow context; None outside a task."""
    ti = context.get("ti") if context else None
    if ti is None:
        return None
    return {
        "name": "Airflow",
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": int(ti.map_index if getattr(ti, "map_index", None) is not None else -1),
        "try_number": int(getattr(ti, "try_number", 0) or 0),
    }


def airflow_task_state(worker: Mapping[str, Any]) -> str | None:
    """Airflow's own state of the task instance a stage recorded (:func:`task_instance`),
    asked through the Task SDK of the task that asks (the API server, not the metadata database
    and not the other worker's host); None where it has none, or where the stage ran in another
    orchestrator."""
    ti = worker.get("orchestrator")
    if not isinstance(ti, Mapping) or ti.get("name") != "Airflow":
        return None
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    index = int(ti.get("map_index", -1))
    found = RuntimeTaskInstance.get_task_states(
        dag_id=str(ti["dag_id"]),
        task_ids=[str(ti["task_id"])],
        run_ids=[str(ti["run_id"])],
        map_index=index if index >= 0 else None,
    )
    key = str(ti["task_id"]) if index < 0 else f"{ti['task_id']}_{index}"
    state = (found.get(str(ti["run_id"])) or {}).get(key)
    return None if state is None else str(state)
