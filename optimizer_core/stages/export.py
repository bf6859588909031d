"""The export stage: resolve the registry version, refuse a graphtrim variant as a source, look up
what earlier runs decided, check the data files against the model's signature, open the
pipeline's MLflow run and store the model as ONNX."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from graphtrim.stages.context import DataFiles, PipelineConfig, PipelineError, StageContext
from graphtrim.stages.records import ExportRecord
from graphtrim.stages.tracking import (
    T,
    client,
    log_metrics,
    open_run,
    params,
    quote,
    stage_run,
    worker,
)

logger = logging.getLogger("graphtrim.stages")


def refuse_variant_source(ctx: StageContext, source: Any) -> None:
    """A version graphtrim registered is a variant, not a new model: optimizing it again would
    feed the pipeline its own output. Refused unless asked for explicitly."""
    from graphtrim.integrations.registry import VARIANT_TAG, is_graphtrim_output

    if ctx.allow_variant_source or not is_graphtrim_output(source.tags):
        return
    of = source.tags.get(T + "source.version")
    raise PipelineError(
        f"{source.uri} is a graphtrim variant ({source.tags.get(VARIANT_TAG, '?')}"
        + (f" of version {of}" if of else "")
        + "), not a source version: skipped (allow_variant_source / --allow-variant-source "
        "optimizes it anyway)"
    )


def _verdict_from_version(lineage: Mapping[str, Any]) -> dict[str, Any] | None:
    """The recorded summary of a registered variant (its gates passed), from
    :meth:`Registry.lineage`."""
    if not lineage["gates"]:
        return None
    tags = lineage["tags"]
    return {
        "passed": True,
        "gates": lineage["gates"],
        "metrics": lineage["metrics"],
        "reasons": [],
        "model": {"uri": tags.get(T + "artifact", ""), "sha256": tags.get(T + "sha256", "")},
    }


def _from_policy_verdict(lineage: Mapping[str, Any], verdict: Mapping[str, Any]) -> dict[str, Any]:
    """A version's summary as one policy judged it (its ``graphtrim.verdict.<hash>`` tag):
    the numbers of the version's logged model, the gates and outcome of that policy."""
    tags = lineage["tags"]
    return {
        "passed": bool(verdict["passed"]),
        "gates": dict(verdict.get("gates") or {}),
        "metrics": {**(verdict.get("metrics") or {}), **lineage["metrics"]},
        "reasons": list(verdict.get("reasons") or []),
        "model": {"uri": tags.get(T + "artifact", ""), "sha256": tags.get(T + "sha256", "")},
    }


def variant_identity(config: PipelineConfig, source: Mapping[str, Any], variant: str) -> str:
    """The identity of ``variant`` of ``source`` under ``config`` with the libraries
    installed here (:mod:`graphtrim.integrations.lineage`)."""
    from graphtrim.integrations.lineage import identity_key
    from graphtrim.integrations.serving import library_versions

    return identity_key(source, variant, config, library_versions())


def prior_verdicts(
    ctx: StageContext, config: PipelineConfig, source: Any, target: str
) -> dict[str, dict[str, Any]]:
    """What earlier runs decided for each requested variant of ``source``: a version that
    holds the variant (same identity: the same bytes) and a verdict of this run's gate
    policy, on its tags; else a measured verdict of a finished run with the same identity
    and policy. A verdict that was not reached (a timeout, a child killed from outside) is
    not an answer: the variant is measured again, until ``ctx.unreached_retries`` further
    runs have not reached it either; then the last one is reported as it stands. Looked up
    before any work, so a re-run rebuilds and re-times nothing it has an answer for.

    A variant that exists under another policy's verdict only is built and judged again;
    the register stage records the new verdict on that version (it registers no copy)."""
    from graphtrim.integrations.lineage import find_existing, recorded_verdict
    from graphtrim.stages.register import lineage_key

    registry = ctx.registry()
    src = source.to_json()
    policy_hash = config.gate_policy().digest()
    identities = {v: variant_identity(config, src, v) for v in config.variants}
    out: dict[str, dict[str, Any]] = {}
    for variant in config.variants:
        mv = find_existing(registry, target, key=identities[variant])
        legacy = False
        if mv is None:  # registered before identities, under this very config
            mv = find_existing(registry, target, key=lineage_key(src, variant, config.config_hash))
            legacy = True
        if mv is None:
            continue
        lineage = registry.lineage(mv)
        verdict = recorded_verdict(lineage["tags"], policy_hash)
        if verdict is not None:
            summary: dict[str, Any] | None = _from_policy_verdict(lineage, verdict)
        elif legacy:
            summary = _verdict_from_version(lineage)
        else:
            summary = None  # judged under another policy only: judged again
        if summary is not None:
            where = {"name": target, "version": str(mv.version), "created": False}
            summary["registered" if summary["passed"] else "existing"] = where
            out[variant] = summary
    missing = [v for v in config.variants if v not in out]
    if not missing:
        return out
    mlflow = client(ctx)
    exp = mlflow.get_experiment_by_name(config.experiment)
    if exp is None:
        return out
    runs = mlflow.search_runs(
        [exp.experiment_id],
        f"tags.`{T}source.name` = '{quote(source.name)}' and "
        f"tags.`{T}source.version` = '{quote(source.version)}' and "
        "attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=100,
    )
    for variant in missing:
        unreached: list[dict[str, Any]] = []
        for run in runs:
            summary = _run_verdict(run, variant, identities[variant], policy_hash, config)
            if summary is None:
                continue
            if summary.get("measured", True):
                # a measured failure stands; a pass whose version is gone is redone
                if not summary.get("passed"):
                    out[variant] = {**summary, "run_id": run.info.run_id}
                break
            unreached.append(summary)
        if variant in out:
            continue
        if unreached and len(unreached) > ctx.unreached_retries:
            out[variant] = {**unreached[0], "attempts": len(unreached)}
        elif unreached:
            ctx.say(
                f"export: {variant} was not reached by {len(unreached)} earlier run(s) "
                f"({unreached[0].get('reasons', ['?'])[0]}): measured again"
            )
    return out


def _run_verdict(
    run: Any, variant: str, identity: str, policy_hash: str, config: PipelineConfig
) -> dict[str, Any] | None:
    """A run's verdict on ``variant`` (its ``graphtrim.verdict.<variant>`` tag) where it is
    about the same identity under the same policy (or, written before identities, the same
    config)."""
    raw = run.data.tags.get(f"{T}verdict.{variant}")
    if not raw:
        return None
    try:
        summary = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(summary, dict):
        return None
    if "identity" in summary:
        if summary["identity"] != identity or summary.get("policy_hash") != policy_hash:
            return None
    elif run.data.tags.get(f"{T}config_hash") != config.config_hash:
        return None
    return summary


def _check_data(ctx: StageContext, data: DataFiles, folder: Path) -> None:
    """Calibration and evaluation files against the registered model's input signature, before
    the export runs: a wrong file fails in seconds with one line, and no run is opened."""
    from graphtrim.data import input_specs, specs_from_signature
    from graphtrim.data_check import check_data
    from graphtrim.exporter import read_mlmodel

    wanted = {
        role: key
        for role, key in (("calibration", "calibration"), ("evaluation", "eval_data"))
        if data.has(key)
    }
    if not wanted:
        return
    doc = read_mlmodel(folder)
    specs = specs_from_signature(doc)
    if specs is None and "onnx" in doc.get("flavors", {}):
        onnx_file = doc["flavors"]["onnx"].get("data")
        if onnx_file and (folder / onnx_file).is_file():
            specs = input_specs(folder / onnx_file)
    if specs is None:
        ctx.say("export: the model has no input signature: data files are checked after export")
        return
    for role, key in wanted.items():
        check_data(data.path(key), specs, role=role)


def export(ctx: StageContext, config: PipelineConfig, model_uri: str) -> ExportRecord:
    """Resolve ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` and store it as ONNX.

    Before any work: a version graphtrim registered is refused (unless
    ``ctx.allow_variant_source``), the verdicts of earlier runs for the requested variants are
    looked up (unless ``ctx.rejudge``: what is known is reported, not rebuilt), and the data
    files are checked against the model's signature (each file fetched once, for its hash and
    its check alike)."""
    from graphtrim.exporter import to_onnx
    from graphtrim.integrations.model_files import model_files
    from graphtrim.modelio import read_proto

    with ctx.scratch("export") as tmp:
        data = DataFiles(ctx, config, tmp / "data")
        config = config.resolved(ctx, data)
        registry = ctx.registry()
        source = registry.resolve(model_uri)
        refuse_variant_source(ctx, source)
        target = config.target_name or source.name
        reused = {} if ctx.rejudge else prior_verdicts(ctx, config, source, target)
        record = ExportRecord(
            worker=worker(ctx),
            source=source.to_json(),
            config_hash=config.config_hash,
            config=config.to_json(),
            reused=reused,
        )
        if reused:
            ctx.say(
                f"export: {', '.join(sorted(reused))} judged before (same identity, same gate "
                "policy): reported as recorded, not rebuilt or re-timed (rejudge to measure again)"
            )
        if all(v in reused for v in config.variants):
            record.run_id = open_run(ctx, config, source)
            with stage_run(ctx, record.run_id, "export") as mlflow:
                mlflow.set_tag(record.run_id, T + "reused", ",".join(sorted(reused)))
            return record
        store = ctx.store()
        ctx.say(f"export: downloading {source.uri}")
        folder = Path(registry.download(source, str(tmp / "download")))
        _check_data(ctx, data, folder)
        run_id = open_run(ctx, config, source)
        with stage_run(ctx, run_id, "export") as mlflow:
            if reused:
                mlflow.set_tag(run_id, T + "reused", ",".join(sorted(reused)))
            onnx_path = tmp / "onnx" / "model.onnx"
            info = to_onnx(
                folder, onnx_path, registry=registry.where, fx_simplify=config.fx_simplify
            )
            read_proto(onnx_path)  # the exported file is a valid model before anything refers to it
            stored = store.put_model(
                onnx_path,
                model=source.name,
                version=source.version,
                stage="export",
                parents=[source.uri],
                extra={"export": info.to_json(), "source": source.to_json()},
            )
            mlflow.log_batch(
                run_id, params=params({"exporter": info.exporter, "flavor": info.flavor})
            )
            mlflow.set_tag(run_id, T + "export.uri", stored.uri)
            for note in info.notes:
                logger.warning("export: %s", note)
            size = sum(p.stat().st_size for p in model_files(onnx_path))
            log_metrics(mlflow, run_id, {"export.bytes": size})
    record.run_id = run_id
    record.model = stored.to_json()
    record.export = info.to_json()
    return record
