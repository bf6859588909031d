"""The register stage: log every variant that passed its gates as an MLflow ONNX model and
register it, with lineage tags, as a new version of the target model, at most once per source
version, variant and config (its lineage key)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optimizer_core.redact import redact
from optimizer_core.stages.context import PipelineConfig, StageContext
from optimizer_core.stages.records import OptimizeRecord, RegisterRecord, ValidateRecord
from optimizer_core.stages.tracking import T, stage_run, worker


def lineage_key(source: Mapping[str, Any], variant: str, config_hash: str) -> str:
    """The idempotency key of one variant of one source version under one config."""
    text = f"{source['name']}\n{source['version']}\n{variant}\n{config_hash}"
    return hashlib.sha256(text.encode()).hexdigest()


def _logged_model(client: Any, experiment_id: str, key: str) -> Any | None:
    """A READY logged model of an earlier attempt with lineage key ``key``."""
    found = client.search_logged_models(
        experiment_ids=[experiment_id], filter_string=f"tags.`{T}key` = '{key}'"
    )
    ready = [m for m in found if str(getattr(m, "status", "")).upper().endswith("READY")]
    return ready[0] if ready else None


def log_onnx(
    client: Any,
    experiment_id: str,
    run_id: str,
    name: str,
    path: Path,
    tags: Mapping[str, str],
    scratch: Path,
) -> str:
    """Log the ONNX file at ``path`` as an MLflow model (onnx + pyfunc flavors) of ``run_id``
    through ``client`` alone (no process-wide MLflow state); returns ``models:/<model_id>``.
    The logged model is READY only once its files are uploaded; FAILED if anything breaks."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    from optimizer_core.integrations.serving import save_onnx_model

    logged = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, tags=dict(tags), model_type="onnx"
    )
    try:
        local = scratch / f"mlflow-{name}"
        meta = Model(
            artifact_path=logged.artifact_location,
            model_uuid=logged.model_id,
            run_id=run_id,
            model_id=logged.model_id,
        )
        save_onnx_model(path, local, mlflow_model=meta)
        client.log_model_artifacts(logged.model_id, str(local))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        with contextlib.suppress(Exception):
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    return f"models:/{logged.model_id}"


def register(
    ctx: StageContext,
    config: PipelineConfig,
    optimized: OptimizeRecord | Mapping[str, Any],
    validated: ValidateRecord | Mapping[str, Any],
) -> RegisterRecord:
    """Log every variant that passed its gates as an MLflow ONNX model and register it, with
    lineage tags, as a new version of the target model. Variants that failed are recorded in
    the run, never registered. A variant registered before (same lineage key) is reported,
    not registered again."""
    from optimizer_core.integrations.registry import KEY_TAG
    from optimizer_core.integrations.serving import library_versions

    config = config.resolved(ctx)
    opt = OptimizeRecord.from_json(optimized)
    val = ValidateRecord.take(validated, ("run_id", "source", "variants"), "register")
    run_id = val.run_id
    source = val.source
    target = config.target_name or source["name"]
    registry = ctx.registry()
    versions = json.dumps(library_versions(), sort_keys=True)
    registered: dict[str, Any] = {}
    failed: dict[str, list[str]] = {}
    with stage_run(ctx, run_id, "register") as client, ctx.scratch("register") as tmp:
        experiment_id = client.get_run(run_id).info.experiment_id
        for variant, summary in val.variants.items():
            if not summary.get("reused"):  # what a re-run reports instead of judging again
                verdict = {k: summary.get(k) for k in ("passed", "gates", "metrics", "reasons")}
                if verdict["reasons"]:
                    verdict["reasons"] = [redact(r) for r in verdict["reasons"]]
                text = json.dumps(verdict, sort_keys=True)
                if len(text) <= 5000:
                    client.set_tag(run_id, f"{T}verdict.{variant}", text)
            if not summary["passed"]:
                failed[variant] = summary["reasons"] or ["failed"]
                client.set_tag(
                    run_id, f"{T}failed.{variant}", redact("; ".join(failed[variant]))[:5000]
                )
                continue
            if summary.get("registered"):  # registered by an earlier run under this key
                registered[variant] = dict(summary["registered"])
                ctx.say(
                    f"register: {variant} is already version {summary['registered']['version']} "
                    f"of {summary['registered']['name']}"
                )
                continue
            key = lineage_key(source, variant, config.config_hash)
            existing = registry.find_by_key(target, key)
            if existing is not None:
                ctx.say(f"register: {variant} is already version {existing.version} of {target}")
                registered[variant] = {
                    "name": target,
                    "version": str(existing.version),
                    "created": False,
                }
                continue
            tags = {
                T + "source.name": source["name"],
                T + "source.version": str(source["version"]),
                T + "source.model_id": str(source.get("model_id") or ""),
                T + "source.run_id": str(source.get("run_id") or ""),
                T + "variant": variant,
                T + "preset": config.preset,
                T + "passes": ",".join(opt.passes),
                T + "config_hash": config.config_hash,
                T + "gates": json.dumps(summary["gates"], sort_keys=True),
                T + "metrics": json.dumps(
                    {k: v for k, v in summary["metrics"].items() if v is not None}, sort_keys=True
                ),
                T + "fingerprint": val.fingerprint,
                T + "device": val.device or config.device,
                T + "versions": versions,
                T + "pipeline_run_id": run_id,
                T + "orchestrator_run_id": ctx.orchestrator_run_id or "",
                T + "artifact": summary["model"]["uri"],
                T + "sha256": summary["model"]["sha256"],
            }
            logged = _logged_model(client, experiment_id, key)
            if logged is None:
                ctx.say(f"register: logging {variant}")
                path = ctx.fetch(summary["model"]["uri"], tmp / variant)
                model_uri = log_onnx(
                    client, experiment_id, run_id, variant, path, {**tags, KEY_TAG: key}, tmp
                )
            else:
                model_uri = f"models:/{logged.model_id}"
            version, created = registry.register(
                model_uri, target, tags=tags, key=key, run_id=run_id
            )
            ctx.say(f"register: {variant} -> {target} version {version}")
            registered[variant] = {"name": target, "version": version, "created": created}
        client.log_dict(
            run_id, {"registered": registered, "failed": failed}, "graphtrim/registered.json"
        )
    return RegisterRecord(
        worker=worker(ctx),
        run_id=run_id,
        source=source,
        target=target,
        registered=registered,
        failed=failed,
    )
