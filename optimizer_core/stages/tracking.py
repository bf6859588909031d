"""The pipeline run in MLflow: one run per pipeline run, found again by the orchestrator's run id,
marked RUNNING while a stage works and FAILED or KILLED with the error when one fails; each
stage logs its tags, params and metrics into it through the context's own client (with that
context's credentials, no process-wide MLflow state).

Every lineage tag starts with ``graphtrim.`` (:data:`T`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from graphtrim.redact import redact
from graphtrim.stages.context import PipelineConfig, PipelineError, StageContext, TaskStateFn

logger = logging.getLogger("graphtrim.stages")

T = "graphtrim."  # tag prefix of every lineage tag


def client(ctx: StageContext) -> Any:
    """An ``MlflowClient`` for the context's tracking server, with its credentials."""
    return ctx.mlflow_client()


def artifact_location(ctx: StageContext) -> str | None:
    """Where a new experiment keeps its MLflow artifacts. A tracking server decides for
    itself; an embedded (database) tracking URI would otherwise write ``./mlruns`` wherever
    the process happens to run, so its artifacts go beside graphtrim's own."""
    if ctx.tracking_uri.startswith(("http://", "https://", "databricks")):
        return None
    if ctx.artifacts.startswith("s3://"):
        return ctx.artifacts.rstrip("/") + "/mlflow-artifacts"
    from graphtrim.integrations.entries import local_path

    return (local_path(ctx.artifacts).resolve() / "mlflow-artifacts").as_uri()


def experiment_id(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of the experiment ``name``, created (at ``artifact_location``) when missing; a
    deleted one is refused."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise PipelineError(
                f"MLflow experiment '{name}' is deleted: restore it or choose another name"
            )
        return str(exp.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifact_location))
    except MlflowException:  # created concurrently
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


def quote(value: str) -> str:
    """``value`` inside single quotes of an MLflow search filter."""
    return str(value).replace("'", "\\'")


def open_run(ctx: StageContext, config: PipelineConfig, source: Any) -> str:
    """The MLflow run of this pipeline run: found again by the orchestrator's run id (a retried
    export stage logs into the same run), created otherwise."""
    mlflow = client(ctx)
    exp = experiment_id(mlflow, config.experiment, artifact_location(ctx))
    tags = {
        T + "source.name": source.name,
        T + "source.version": source.version,
        T + "source.uri": source.uri,
        T + "config_hash": config.config_hash,
        T + "pipeline": "1",
    }
    close_dead_runs(mlflow, exp, ctx.task_state)
    if ctx.orchestrator_run_id:
        tags[T + "orchestrator_run_id"] = ctx.orchestrator_run_id
        found = mlflow.search_runs(
            [exp],
            " and ".join(f"tags.`{k}` = '{quote(v)}'" for k, v in tags.items()),
            max_results=1,
        )
        if found:
            return str(found[0].info.run_id)
    run = mlflow.create_run(exp, run_name=f"{source.name}-v{source.version}", tags=tags)
    run_id = str(run.info.run_id)
    params = {
        "source": source.uri,
        "variants": ",".join(config.variants),
        "preset": config.preset,
        "device": config.device,
        "config_hash": config.config_hash,
        "policy_hash": config.gate_policy().digest(),
    }
    if config.opset is not None:
        params["opset"] = str(config.opset)
    from mlflow.entities import Param

    mlflow.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    mlflow.log_dict(run_id, config.to_json(), "graphtrim/config.json")
    return run_id


def close_dead_runs(
    client: Any, experiment_id: str, task_state: TaskStateFn | None = None
) -> list[str]:
    """End as KILLED the pipeline runs still RUNNING whose stages are gone (killed, crashed,
    out of memory; :func:`..scan.dead_stages`): by the orchestrator's state of the task
    instance each stage recorded (``task_state``, wherever it ran), else, on this host, by its
    process. A run never stays RUNNING for a dead worker, and the registry scan retries its
    version."""
    from graphtrim.stages.scan import dead_stages

    closed: list[str] = []
    try:
        runs = client.search_runs(
            [experiment_id],
            f"tags.`{T}pipeline` = '1' and attributes.status = 'RUNNING'",
            max_results=200,
        )
    except Exception:  # a store that cannot filter on status: nothing to close
        return closed
    for run in runs:
        why = dead_stages(dict(run.data.tags or {}), task_state)
        if why is None:
            continue
        with contextlib.suppress(Exception):
            client.set_tag(
                run.info.run_id, T + "error", redact(f"ended without closing this run: {why}")
            )
            client.set_terminated(run.info.run_id, status="KILLED")
            closed.append(str(run.info.run_id))
            logger.warning("closed pipeline run %s: %s", run.info.run_id, why)
    return closed


def worker(ctx: StageContext) -> dict[str, Any]:
    """Where this stage runs: host, worker name (``$GRAPHTRIM_WORKER_NAME``), process, and what
    the orchestrator adds (its queue, task id)."""
    import os
    import socket

    return {
        "host": socket.gethostname(),
        "name": os.environ.get("GRAPHTRIM_WORKER_NAME", ""),
        "pid": os.getpid(),
        **dict(ctx.worker or {}),
    }


@contextlib.contextmanager
def stage_run(
    ctx: StageContext, run_id: str, name: str, *, last: bool = False, label: str | None = None
) -> Iterator[Any]:
    """Mark the run RUNNING while the stage works; FAILED (with the error) if it raises. The
    MLflow run records where the stage (``label``: the stage and its variants) ran, and how long
    its own work took (``graphtrim.seconds.<label>``: what an orchestrator adds is the task's
    wall time minus this). Yields the MLflow client."""
    import time

    start = time.perf_counter()
    mlflow = client(ctx)
    mlflow.update_run(run_id, status="RUNNING")
    # where the stage runs (host, pid): until its seconds are recorded below, a later start on
    # this host closes the run if that process is gone (:func:`close_dead_runs`)
    mlflow.set_tag(
        run_id, f"{T}worker.{label or name}", json.dumps(worker(ctx), sort_keys=True)[:5000]
    )
    ctx.say(f"{name}: started")
    try:
        yield mlflow
    except BaseException as exc:
        # interrupted (Ctrl-C, a termination signal): KILLED; anything else: FAILED
        status = "FAILED" if isinstance(exc, Exception) else "KILLED"
        with contextlib.suppress(Exception):
            mlflow.set_tag(run_id, T + "failed_stage", name)
            mlflow.set_tag(run_id, T + "error", redact(f"{type(exc).__name__}: {exc}")[:5000])
            mlflow.set_terminated(run_id, status=status)
        raise
    mlflow.set_tag(run_id, T + "last_stage", name)
    mlflow.set_tag(run_id, f"{T}seconds.{label or name}", f"{time.perf_counter() - start:.3f}")
    if last:
        mlflow.set_terminated(run_id, status="FINISHED")
    ctx.say(f"{name}: done")


def log_metrics(
    client: Any,
    run_id: str,
    metrics: Mapping[str, float | int | None],
    *,
    model_id: str | None = None,
) -> None:
    """Log the numeric ``metrics`` (None and NaN left out) in batches MLflow accepts; with
    ``model_id`` they are also the metrics of that logged model."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(metric_key(k), float(v), now, 0, model_id=model_id)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # no None, NaN
    ]
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def metric_key(key: str) -> str:
    """``key`` with the characters MLflow refuses in a metric name replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def params(values: Mapping[str, Any]) -> list[Any]:
    """MLflow ``Param`` entities of ``values``, each cut to the length MLflow takes."""
    from mlflow.entities import Param

    return [Param(k, str(v)[:6000]) for k, v in values.items()]


def publish_reports(
    store: Any,
    client: Any,
    run_id: str,
    source: Mapping[str, Any],
    config_hash: str,
    written: Mapping[str, Any],
) -> dict[str, str]:
    """Put a stage's report files (kind -> path, all in one folder) into the artifact
    ``store`` under ``<model>/<version>/reports/<config>/<run>/`` and log them as the run's
    ``graphtrim/reports``; returns kind -> URI."""
    from pathlib import Path

    from graphtrim.integrations.entries import safe_part

    prefix = "/".join(
        (
            safe_part(source["name"]),
            safe_part(source["version"]),
            "reports",
            config_hash[:16],
            run_id,
        )
    )
    paths = {kind: Path(path) for kind, path in written.items()}
    uris = {kind: store.put_file(path, f"{prefix}/{path.name}") for kind, path in paths.items()}
    folders = {str(path.parent) for path in paths.values()}
    for folder in sorted(folders):
        client.log_artifacts(run_id, folder, "graphtrim/reports")
    return uris
