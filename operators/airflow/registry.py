"""Operators that find the registered versions to optimize, for the registry DAGs.

Each returns the keyword arguments of one ``TriggerDagRunOperator`` per version (``conf`` and
``trigger_run_id``), to be expanded over a trigger of ``graphtrim_optimize_model``:

- :class:`RegistryScanOperator` asks the registry (``graphtrim.stages.scan``): the newest
  versions of the watched models that have neither a variant nor a finished or live run under
  the current config.
- :class:`RegistryEventsOperator` reads the asset events that started its DAG run (one per new
  version, from ``MlflowNewModelVersionTrigger``).

The run id is the work's idempotency key (``graphtrim.stages.scan.run_key``): a second
scan, or an event and a scan, asking for the same version and config is skipped by Airflow's
unique run id, not by luck.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from graphtrim.airflow.context import airflow_task_state, stage_context
from graphtrim.airflow.hooks import ArtifactStoreHook, MlflowRegistryHook
from graphtrim.airflow.params import as_flag

if TYPE_CHECKING:
    from graphtrim.stages.context import StageContext


def _trigger_arguments(found: Mapping[str, Any]) -> dict[str, Any]:
    """``TriggerDagRunOperator`` arguments of one ``{"conf", "run_id"}`` of the scan."""
    return {"conf": found["conf"], "trigger_run_id": found["run_id"]}


class RegistryScanOperator(BaseOperator):
    """Trigger arguments for each version of a watched model that still needs a run, at most
    ``max_runs``: the ``versions_per_model`` newest versions of every registered model tagged
    ``watch_tag = true`` that graphtrim did not produce (unless ``allow_variant_source``).
    ``artifacts``, when set, goes into each run's conf. XCom: a list of
    ``{"conf", "trigger_run_id"}``."""

    template_fields: Sequence[str] = (
        "max_runs",
        "versions_per_model",
        "watch_tag",
        "artifacts",
        "allow_variant_source",
    )
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        max_runs: Any = 10,
        versions_per_model: Any = 1,
        watch_tag: str = "graphtrim.optimize",
        artifacts: str | None = None,
        allow_variant_source: Any = False,
        mlflow_conn_id: str = MlflowRegistryHook.default_conn_name,
        aws_conn_id: str | None = ArtifactStoreHook.default_conn_name,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.max_runs = max_runs
        self.versions_per_model = versions_per_model
        self.watch_tag = watch_tag
        self.artifacts = artifacts
        self.allow_variant_source = allow_variant_source
        self.mlflow_conn_id = mlflow_conn_id
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from graphtrim.stages.scan import unoptimized_versions

        artifacts = str(self.artifacts or "") or None
        ctx = stage_context(
            artifacts or ".",
            mlflow_conn_id=self.mlflow_conn_id,
            aws_conn_id=self.aws_conn_id,
            task_state=airflow_task_state,  # a run RUNNING on a dead worker is retried
        )
        found = unoptimized_versions(
            ctx,
            watch_tag=str(self.watch_tag),
            versions_per_model=int(self.versions_per_model),
            limit=int(self.max_runs),
            allow_variant_source=as_flag(self.allow_variant_source),
        )
        if artifacts:
            for item in found:
                item["conf"]["artifacts"] = artifacts
        return [_trigger_arguments(f) for f in found]


def event_versions(triggering_asset_events: Any) -> list[dict[str, Any]]:
    """``{"name", "version"}`` (and ``"allow_variant_source": True`` for a variant let through
    on purpose) of each event that names a version, in order: an event's ``extra`` is the
    trigger's payload, or holds it under ``payload``."""
    out: list[dict[str, Any]] = []
    for events in (triggering_asset_events or {}).values():
        for event in events:
            payload = (event.extra or {}).get("payload") or event.extra or {}
            if payload.get("name") and payload.get("version"):
                item = {"name": payload["name"], "version": str(payload["version"])}
                if payload.get("allow_variant_source"):
                    item["allow_variant_source"] = True
                out.append(item)
    return out


def event_trigger_arguments(
    ctx: StageContext, triggering_asset_events: Any
) -> list[dict[str, Any]]:
    """Trigger arguments of one optimize run per version in the events, each once: the conf
    from the registered model's ``graphtrim.*`` tags, and the run id the registry scan would
    use for the same work (so the two never both run it)."""
    from graphtrim.stages.scan import conf_for

    out: list[dict[str, Any]] = []
    for event in event_versions(triggering_asset_events):
        found = conf_for(ctx, event["name"], event["version"])
        if event.get("allow_variant_source"):  # a variant, let through on purpose
            found["conf"]["allow_variant_source"] = True
        item = _trigger_arguments(found)
        if item not in out:
            out.append(item)
    return out


class RegistryEventsOperator(BaseOperator):
    """Trigger arguments of one optimize run per new version in the asset events that started
    this DAG run (see :func:`event_trigger_arguments`). The S3 connection is used to read the
    calibration and evaluation data the models' tags name (their hashes are part of the
    config). XCom: a list of ``{"conf", "trigger_run_id"}``."""

    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        mlflow_conn_id: str = MlflowRegistryHook.default_conn_name,
        aws_conn_id: str | None = ArtifactStoreHook.default_conn_name,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.mlflow_conn_id = mlflow_conn_id
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Any) -> list[dict[str, Any]]:
        ctx = stage_context(
            ".",
            mlflow_conn_id=self.mlflow_conn_id,
            aws_conn_id=self.aws_conn_id,
            s3_connection=True,
        )
        return event_trigger_arguments(ctx, context.get("triggering_asset_events"))


def optimize_each(runs: Any) -> Any:
    """The DAG's ``optimize`` task: one ``graphtrim_optimize_model`` run per item of ``runs`` (an
    upstream task's output, each item a run's ``conf`` and id), one already there skipped."""
    from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
    from graphtrim.airflow.timeouts import task_timeout

    return TriggerDagRunOperator.partial(
        task_id="optimize",
        execution_timeout=task_timeout("trigger"),
        trigger_dag_id="graphtrim_optimize_model",
        skip_when_already_exists=True,
    ).expand_kwargs(runs)
