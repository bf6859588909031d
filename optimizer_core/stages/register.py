"""The register stage: log every variant that passed its gates as an MLflow ONNX model and
register it, with lineage, as a new version of the target model, at most once per identity
(what determines the variant's bytes: :mod:`graphtrim.integrations.lineage`). A variant that
is a version already gets this run's verdict recorded on that version (a tag per gate policy),
not a copy.

What MLflow shows of a registered variant: the logged model carries the variant's settings as
params and its numbers as metrics (``<variant>.speedup``, ...), linked to the version; the
version's description (Markdown) says what it is, each gate with its numbers against its
limits, and where the run's comparison report is; its tags are short and searchable (source,
variant, preset, config hash, gate verdicts, artifact and sha256). ``model.onnx`` and its data
files in MLflow are the artifact store's bytes: ``graphtrim.sha256`` holds for both.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim import faults
from graphtrim.redact import redact
from graphtrim.stages.context import PipelineConfig, StageContext
from graphtrim.stages.records import OptimizeRecord, RegisterRecord, ValidateRecord
from graphtrim.stages.tracking import T, log_metrics, stage_run, worker
from graphtrim.stages.version_notes import (
    _conversion_tags,
    _tuning_tags,
    comparison_report,
    describe,
)

logger = logging.getLogger("graphtrim.stages")


def lineage_key(source: Mapping[str, Any], variant: str, config_hash: str) -> str:
    """The key versions registered before identities carry: one variant of one source
    version under one whole config (read to find them, no longer written)."""
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
    *,
    params: Mapping[str, str] | None = None,
    metrics: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> str:
    """Log the ONNX file at ``path`` as an MLflow model (onnx + pyfunc flavors) of ``run_id``
    through ``client`` alone (no process-wide MLflow state), with ``params``, ``metrics`` and a
    Markdown ``description``; returns ``models:/<model_id>``. The logged model is READY only
    once its files, params and metrics are in; FAILED if anything breaks."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    from graphtrim.integrations.serving import save_onnx_model

    extra = {"mlflow.note.content": description} if description else {}
    logged = client.create_logged_model(
        experiment_id,
        name=name,
        source_run_id=run_id,
        tags={**tags, **extra},
        params=dict(params or {}),
        model_type="onnx",
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
        log_metrics(client, run_id, dict(metrics or {}), model_id=logged.model_id)
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        with contextlib.suppress(Exception):
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    return f"models:/{logged.model_id}"


def _params(
    variant: str,
    config: PipelineConfig,
    opt: OptimizeRecord,
    val: ValidateRecord,
    versions: Mapping[str, str],
) -> dict[str, str]:
    """A registered variant's settings, as its logged model's params."""
    params = {
        "variant": variant,
        "preset": config.preset,
        "device": config.device,
        "tensorrt": str(config.tensorrt).lower(),
        "fallback": str(config.fallback).lower(),
        "config_hash": config.config_hash,
        "policy_hash": val.policy_hash,
        "fingerprint": val.fingerprint,
        "passes": ",".join(opt.passes),
    }
    if config.opset is not None:
        params["opset"] = str(config.opset)  # raised to it before the graph passes
    for kind, sha in (config.data_sha256 or {}).items():
        params[f"data.{kind}.sha256"] = sha
    for dist, version in versions.items():
        params[f"version.{dist}"] = version
    return {k: v[:6000] for k, v in params.items() if v}


def register(
    ctx: StageContext,
    config: PipelineConfig,
    optimized: OptimizeRecord | Mapping[str, Any],
    validated: ValidateRecord | Mapping[str, Any],
) -> RegisterRecord:
    """Log every variant that passed its gates as an MLflow ONNX model and register it, with
    lineage, as a new version of the target model; write the run's comparison report first.
    Variants that failed are recorded in the run, never registered. A variant that is a
    version already (the same identity, or the same source, variant and sha256) is not
    registered again: this run's verdict is recorded on that version under its policy's
    hash, passed or failed."""
    from graphtrim.integrations.lineage import (
        POLICY_TAG,
        find_existing,
        identity_key,
        verdict_doc,
        verdict_tag,
    )
    from graphtrim.integrations.links import record_links, ui_base
    from graphtrim.integrations.registry import GATES_TAG, KEY_TAG, format_gates
    from graphtrim.integrations.serving import library_versions

    config = config.resolved(ctx)
    opt = OptimizeRecord.from_json(optimized)
    val = ValidateRecord.take(validated, ("run_id", "source", "variants"), "register")
    run_id = val.run_id
    source = val.source
    target = config.target_name or source["name"]
    registry = ctx.registry()
    versions = library_versions()
    registered: dict[str, Any] = {}
    failed: dict[str, list[str]] = {}
    # variants whose identity is a version already: this run's verdict recorded on it
    existing: dict[str, Any] = {}
    policy_hash = val.policy_hash or config.gate_policy().digest()
    with stage_run(ctx, run_id, "register") as client, ctx.scratch("register") as tmp:
        experiment_id = client.get_run(run_id).info.experiment_id
        doc, reports = comparison_report(ctx, client, config, val, tmp)
        report_link = None
        if reports:
            ctx.say(f"register: comparison report {reports['html']}")
            report_link = record_links(
                ui_base(ctx.tracking_uri),
                {"run_id": run_id, "reports": reports},
                experiment_id=experiment_id,
            ).get("report")
        judged = {v["name"]: v for v in (doc or {}).get("variants", [])}
        for variant, summary in val.variants.items():
            identity = identity_key(source, variant, config, versions)
            if not summary.get("reused"):  # what a re-run reports instead of judging again
                verdict = {k: summary.get(k) for k in ("passed", "gates", "metrics", "reasons")}
                if verdict["reasons"]:
                    verdict["reasons"] = [redact(r) for r in verdict["reasons"]]
                verdict.update(
                    measured=summary.get("measured", True),
                    identity=identity,
                    policy_hash=policy_hash,
                )
                text = json.dumps(verdict, sort_keys=True)
                if len(text) <= 5000:
                    client.set_tag(run_id, f"{T}verdict.{variant}", text)
            if summary.get("reused"):  # decided by an earlier run: reported as recorded
                if summary["passed"] and summary.get("registered"):
                    registered[variant] = dict(summary["registered"])
                    ctx.say(
                        f"register: {variant} is already version "
                        f"{summary['registered']['version']} of {summary['registered']['name']}"
                    )
                    continue
                if not summary["passed"]:
                    _record_failure(client, run_id, variant, summary, failed)
                    continue
            if summary.get("measured", True):
                sha = (summary.get("model") or {}).get("sha256")
                mv = find_existing(
                    registry, target, key=identity, source=source, variant=variant, sha256=sha
                )
                if mv is not None:
                    # the same bytes are a version already: this policy's verdict goes on it
                    registry.client.set_model_version_tag(
                        target,
                        str(mv.version),
                        verdict_tag(policy_hash),
                        verdict_doc(summary, policy_hash, run_id),
                    )
                    where = {"name": target, "version": str(mv.version), "created": False}
                    existing[variant] = where
                    outcome = "PASS" if summary["passed"] else "FAIL"
                    ctx.say(
                        f"register: {variant} is version {mv.version} of {target} (the same "
                        f"variant): {outcome} under policy {policy_hash} recorded on it"
                    )
                    if summary["passed"]:
                        registered[variant] = where
                    else:
                        _record_failure(client, run_id, variant, summary, failed)
                    continue
            if not summary["passed"]:
                _record_failure(client, run_id, variant, summary, failed)
                continue
            key = identity
            # short, searchable tags; the settings are the logged model's params, the numbers
            # its metrics, the detail the comparison report
            tags = {
                T + "source.name": source["name"],
                T + "source.version": str(source["version"]),
                T + "source.model_id": str(source.get("model_id") or ""),
                T + "source.run_id": str(source.get("run_id") or ""),
                T + "variant": variant,
                T + "preset": config.preset,
                T + "device": val.device or config.device,
                T + "config_hash": config.config_hash,
                GATES_TAG: format_gates(summary["gates"]),
                POLICY_TAG: policy_hash,
                verdict_tag(policy_hash): verdict_doc(summary, policy_hash, run_id),
                T + "fingerprint": val.fingerprint,
                T + "pipeline_run_id": run_id,
                T + "orchestrator_run_id": ctx.orchestrator_run_id or "",
                T + "artifact": summary["model"]["uri"],
                T + "sha256": summary["model"]["sha256"],
                **_conversion_tags(summary.get("conversion")),
                **_tuning_tags(summary.get("tuning")),
            }
            tags = {k: v for k, v in tags.items() if v}
            description = describe(
                variant,
                source,
                summary,
                config=config,
                run_id=run_id,
                gates=(judged.get(variant) or {}).get("gates"),
                report=(reports or {}).get("html"),
                report_link=report_link,
            )
            logged = _logged_model(client, experiment_id, key)
            if logged is None:
                ctx.say(f"register: logging {variant}")
                path = ctx.fetch(summary["model"]["uri"], tmp / variant)
                model_uri = log_onnx(
                    client,
                    experiment_id,
                    run_id,
                    variant,
                    path,
                    {**tags, KEY_TAG: key},
                    tmp,
                    params=_params(variant, config, opt, val, versions),
                    metrics={
                        f"{variant}.{k}": v for k, v in (summary.get("metrics") or {}).items()
                    },
                    description=description,
                )
            else:
                model_uri = f"models:/{logged.model_id}"
            faults.point("register.logged.after")
            version, created = registry.register(
                model_uri, target, tags=tags, key=key, run_id=run_id, description=description
            )
            ctx.say(f"register: {variant} -> {target} version {version}")
            registered[variant] = {"name": target, "version": version, "created": created}
        client.log_dict(
            run_id,
            {"registered": registered, "failed": failed, "existing": existing},
            "graphtrim/registered.json",
        )
    return RegisterRecord(
        worker=worker(ctx),
        run_id=run_id,
        source=source,
        target=target,
        registered=registered,
        failed=failed,
        existing=existing,
        reports=reports,
    )


def _record_failure(
    client: Any, run_id: str, variant: str, summary: Mapping[str, Any], failed: dict[str, Any]
) -> None:
    """A variant that failed (or was not reached): kept in the run, never registered."""
    failed[variant] = list(summary.get("reasons") or ["failed"])
    client.set_tag(run_id, f"{T}failed.{variant}", redact("; ".join(failed[variant]))[:5000])
