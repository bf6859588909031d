"""The pipeline's stages as plain functions: records in, a record out.

``export`` -> ``optimize`` -> ``quantize`` -> ``validate`` -> ``register`` -> ``promote``. Each
stage fetches what it needs from the artifact store, writes what it makes back under a
content-addressed key, logs into the pipeline's MLflow run and returns a small JSON record.
Any orchestrator can place each stage on its own worker; ``run_pipeline`` chains them in one
process (the CLI, CI and the demo).

Retrying a stage is safe: the artifact keys are content hashes, the MLflow run is found again
by the orchestrator's run id, and a variant is registered at most once per source version and
config (its lineage key is looked up before anything is logged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from optimizer_core.redact import redact
from optimizer_core.stages.context import (
    PipelineConfig,
    PipelineError,
    StageContext,
    library_versions,
    require,
)

logger = logging.getLogger("graphtrim.stages")

T = "graphtrim."  # tag prefix of every lineage tag


# ---------------------------------------------------------------------------------- MLflow run


def _client(ctx: StageContext) -> Any:
    return ctx.mlflow_client()  # with the context's own credentials


def _artifact_location(ctx: StageContext) -> str | None:
    """Where a new experiment keeps its MLflow artifacts. A tracking server decides for
    itself; an embedded (database) tracking URI would otherwise write ``./mlruns`` wherever
    the process happens to run, so its artifacts go beside graphtrim's own."""
    if ctx.tracking_uri.startswith(("http://", "https://", "databricks")):
        return None
    if ctx.artifacts.startswith("s3://"):
        return ctx.artifacts.rstrip("/") + "/mlflow-artifacts"
    from optimizer_core.integrations.artifacts import _local_path

    return (_local_path(ctx.artifacts).resolve() / "mlflow-artifacts").as_uri()


def _experiment_id(client: Any, name: str, artifact_location: str | None = None) -> str:
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


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")


def _open_run(ctx: StageContext, config: PipelineConfig, source: Any) -> str:
    """The MLflow run of this pipeline run: found again by the orchestrator's run id (a retried
    export stage logs into the same run), created otherwise."""
    client = _client(ctx)
    exp = _experiment_id(client, config.experiment, _artifact_location(ctx))
    tags = {
        T + "source.name": source.name,
        T + "source.version": source.version,
        T + "source.uri": source.uri,
        T + "config_hash": config.config_hash,
        T + "pipeline": "1",
    }
    _close_dead_runs(client, exp)
    if ctx.orchestrator_run_id:
        tags[T + "orchestrator_run_id"] = ctx.orchestrator_run_id
        found = client.search_runs(
            [exp],
            " and ".join(f"tags.`{k}` = '{_quote(v)}'" for k, v in tags.items()),
            max_results=1,
        )
        if found:
            return str(found[0].info.run_id)
    run = client.create_run(exp, run_name=f"{source.name}-v{source.version}", tags=tags)
    run_id = str(run.info.run_id)
    from mlflow.entities import Param

    params = {
        "source": source.uri,
        "variants": ",".join(config.variants),
        "preset": config.preset,
        "device": config.device,
        "config_hash": config.config_hash,
        "policy_hash": config.gate_policy().digest(),
    }
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()])
    client.log_dict(run_id, config.to_json(), "graphtrim/config.json")
    return run_id


def _close_dead_runs(client: Any, experiment_id: str) -> list[str]:
    """End as KILLED the pipeline runs still RUNNING whose stage processes, on this host, are
    gone (killed, crashed, out of memory; :func:`..scan.dead_stages`): a run never stays
    RUNNING for a dead process, and the registry scan retries its version."""
    from optimizer_core.stages.scan import dead_stages

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
        why = dead_stages(dict(run.data.tags or {}))
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
def _stage(
    ctx: StageContext, run_id: str, name: str, *, last: bool = False, label: str | None = None
) -> Iterator[Any]:
    """Mark the run RUNNING while the stage works; FAILED (with the error) if it raises. The
    MLflow run records where the stage (``label``: the stage and its variants) ran, and how long
    its own work took (``graphtrim.seconds.<label>``: what an orchestrator adds is the task's
    wall time minus this)."""
    import time

    start = time.perf_counter()
    client = _client(ctx)
    client.update_run(run_id, status="RUNNING")
    # where the stage runs (host, pid): until its seconds are recorded below, a later start on
    # this host closes the run if that process is gone (:func:`_close_dead_runs`)
    client.set_tag(
        run_id, f"{T}worker.{label or name}", json.dumps(worker(ctx), sort_keys=True)[:5000]
    )
    ctx.say(f"{name}: started")
    try:
        yield client
    except BaseException as exc:
        # interrupted (Ctrl-C, a termination signal): KILLED; anything else: FAILED
        status = "FAILED" if isinstance(exc, Exception) else "KILLED"
        with contextlib.suppress(Exception):
            client.set_tag(run_id, T + "failed_stage", name)
            client.set_tag(run_id, T + "error", redact(f"{type(exc).__name__}: {exc}")[:5000])
            client.set_terminated(run_id, status=status)
        raise
    client.set_tag(run_id, T + "last_stage", name)
    client.set_tag(run_id, f"{T}seconds.{label or name}", f"{time.perf_counter() - start:.3f}")
    if last:
        client.set_terminated(run_id, status="FINISHED")
    ctx.say(f"{name}: done")


def _log_metrics(client: Any, run_id: str, metrics: Mapping[str, float | int | None]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [
        Metric(_metric_key(k), float(v), now, 0)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and v == v  # drop None and NaN
    ]
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def _metric_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


# ---------------------------------------------------------------------------------- stages


def _refuse_variant_source(ctx: StageContext, source: Any) -> None:
    """A version graphtrim registered is a variant, not a new model: optimizing it again would
    feed the pipeline its own output. Refused unless asked for explicitly."""
    from optimizer_core.integrations.registry import VARIANT_TAG, is_graphtrim_output

    if ctx.allow_variant_source or not is_graphtrim_output(source.tags):
        return
    of = source.tags.get(T + "source.version")
    raise PipelineError(
        f"{source.uri} is a graphtrim variant ({source.tags.get(VARIANT_TAG, '?')}"
        + (f" of version {of}" if of else "")
        + "), not a source version: skipped (allow_variant_source / --allow-variant-source "
        "optimizes it anyway)"
    )


def _verdict_from_version(tags: Mapping[str, str]) -> dict[str, Any] | None:
    """The recorded summary of a registered variant (its gates passed)."""
    try:
        gates = json.loads(tags.get(T + "gates", "{}"))
        metrics = json.loads(tags.get(T + "metrics", "{}"))
    except ValueError:
        return None
    if not isinstance(gates, dict) or not isinstance(metrics, dict):
        return None
    return {
        "passed": True,
        "gates": gates,
        "metrics": metrics,
        "reasons": [],
        "model": {"uri": tags.get(T + "artifact", ""), "sha256": tags.get(T + "sha256", "")},
    }


def prior_verdicts(
    ctx: StageContext, config: PipelineConfig, source: Any, target: str
) -> dict[str, dict[str, Any]]:
    """What earlier runs decided for each requested variant of ``source`` under ``config``:
    variants registered under their lineage key (with the verdicts on their tags), and
    variants that failed in a finished run (with its recorded verdict). Looked up before any
    work, so a re-run rebuilds and re-times nothing it has an answer for."""
    from optimizer_core.integrations.registry import RegistryError

    registry = ctx.registry()
    src = source.to_json()
    out: dict[str, dict[str, Any]] = {}
    for variant in config.variants:
        try:
            mv = registry.find_by_key(target, lineage_key(src, variant, config.config_hash))
        except RegistryError:
            mv = None  # no such registered model yet
        if mv is None:
            continue
        summary = _verdict_from_version(dict(mv.tags or {}))
        if summary is not None:
            summary["registered"] = {"name": target, "version": str(mv.version), "created": False}
            out[variant] = summary
    missing = [v for v in config.variants if v not in out]
    if not missing:
        return out
    client = _client(ctx)
    exp = client.get_experiment_by_name(config.experiment)
    if exp is None:
        return out
    runs = client.search_runs(
        [exp.experiment_id],
        f"tags.`{T}source.name` = '{_quote(source.name)}' and "
        f"tags.`{T}source.version` = '{_quote(source.version)}' and "
        f"tags.`{T}config_hash` = '{config.config_hash}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=20,
    )
    for run in runs:
        for variant in missing:
            raw = run.data.tags.get(f"{T}verdict.{variant}")
            if variant in out or not raw:
                continue
            try:
                summary = json.loads(raw)
            except ValueError:
                continue
            # a failed verdict stands; a pass whose version is gone from the registry is redone
            if isinstance(summary, dict) and not summary.get("passed"):
                out[variant] = {**summary, "run_id": run.info.run_id}
    return out


def _check_data(ctx: StageContext, config: PipelineConfig, folder: Path, tmp: Path) -> None:
    """Calibration and evaluation files against the registered model's input signature, before
    the export runs: a wrong file fails in seconds with one line, and no run is opened."""
    from optimizer_core.data import check_data, input_specs, specs_from_signature
    from optimizer_core.stages.export import _mlmodel

    wanted = {
        role: uri
        for role, uri in (("calibration", config.calibration), ("evaluation", config.eval_data))
        if uri
    }
    if not wanted:
        return
    doc = _mlmodel(folder)
    specs = specs_from_signature(doc)
    if specs is None and "onnx" in doc.get("flavors", {}):
        onnx_file = doc["flavors"]["onnx"].get("data")
        if onnx_file and (folder / onnx_file).is_file():
            specs = input_specs(folder / onnx_file)
    if specs is None:
        ctx.say("export: the model has no input signature: data files are checked after export")
        return
    for role, uri in wanted.items():
        path = ctx.fetch_file(uri, tmp / f"{role}.npz")
        check_data(path, specs, role=role)


def export(ctx: StageContext, config: PipelineConfig, model_uri: str) -> dict[str, Any]:
    """Resolve ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` and store it as ONNX.

    Before any work: a version graphtrim registered is refused (unless
    ``ctx.allow_variant_source``), the verdicts of earlier runs for the requested variants are
    looked up (unless ``ctx.rejudge``: what is known is reported, not rebuilt), and the data
    files are checked against the model's signature."""
    from optimizer_core.integrations.artifacts import model_files
    from optimizer_core.modelio import read_proto
    from optimizer_core.stages.export import to_onnx

    config = config.resolved(ctx)
    registry = ctx.registry()
    source = registry.resolve(model_uri)
    _refuse_variant_source(ctx, source)
    target = config.target_name or source.name
    reused = {} if ctx.rejudge else prior_verdicts(ctx, config, source, target)
    record: dict[str, Any] = {
        "stage": "export",
        "worker": worker(ctx),
        "source": source.to_json(),
        "config_hash": config.config_hash,
        "config": config.to_json(),
        "reused": reused,
    }
    if reused:
        ctx.say(
            f"export: {', '.join(sorted(reused))} judged before under this config: reported "
            "as recorded, not rebuilt or re-timed (rejudge to measure again)"
        )
    if all(v in reused for v in config.variants):
        run_id = _open_run(ctx, config, source)
        with _stage(ctx, run_id, "export") as client:
            client.set_tag(run_id, T + "reused", ",".join(sorted(reused)))
        return {**record, "run_id": run_id, "model": None, "export": None}
    store = ctx.store()
    with ctx.scratch("export") as tmp:
        ctx.say(f"export: downloading {source.uri}")
        folder = Path(registry.download(source, str(tmp / "download")))
        _check_data(ctx, config, folder, tmp)
        run_id = _open_run(ctx, config, source)
        with _stage(ctx, run_id, "export") as client:
            if reused:
                client.set_tag(run_id, T + "reused", ",".join(sorted(reused)))
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
            client.log_batch(
                run_id, params=_params({"exporter": info.exporter, "flavor": info.flavor})
            )
            client.set_tag(run_id, T + "export.uri", stored.uri)
            for note in info.notes:
                logger.warning("export: %s", note)
            size = sum(p.stat().st_size for p in model_files(onnx_path))
            _log_metrics(client, run_id, {"export.bytes": size})
    return {**record, "run_id": run_id, "model": stored.to_json(), "export": info.to_json()}


def _params(values: Mapping[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    return [Param(k, str(v)[:6000]) for k, v in values.items()]


def _fetch(ctx: StageContext, record: Mapping[str, Any], dest: Path) -> Path:
    return ctx.fetch(record["model"]["uri"], dest)


def optimize(
    ctx: StageContext, config: PipelineConfig, exported: Mapping[str, Any]
) -> dict[str, Any]:
    """Run the graph optimizer (verified against the export) and store the result."""
    from optimizer_core.graph.presets import PRESETS
    from optimizer_core.optimize_file import optimize_file

    config = config.resolved(ctx)
    require(exported, ("run_id", "source", "model"), "optimize")
    run_id = exported["run_id"]
    source = exported["source"]
    if exported["model"] is None:  # every variant judged before: nothing to optimize
        return {
            "stage": "optimize",
            "worker": worker(ctx),
            "run_id": run_id,
            "source": source,
            "model": None,
            "preset": config.preset,
            "passes": [],
            "changed": [],
            "nodes_before": None,
            "nodes_after": None,
        }
    store = ctx.store()
    with _stage(ctx, run_id, "optimize") as client, ctx.scratch("optimize") as tmp:
        src = _fetch(ctx, exported, tmp / "in")
        dst = tmp / "out" / "model.onnx"
        report = optimize_file(src, dst, preset=config.preset, check=True, progress=ctx.progress)
        stored = store.put_model(
            dst,
            model=source["name"],
            version=source["version"],
            stage="optimize",
            parents=[exported["model"]["sha256"]],
            config_hash=config.hash_for("preset"),
            extra={"preset": config.preset},
        )
        doc = report.to_json()
        client.log_dict(run_id, doc, "graphtrim/optimize.json")
        changed = [
            name
            for name, agg in report.log.per_pass().items()
            if agg["nodes_removed"] or agg["nodes_added"] or agg["rules"]
        ]
        _log_metrics(
            client,
            run_id,
            {
                "nodes_before": report.before.nodes,
                "nodes_after": report.after.nodes,
                "optimize.seconds": report.seconds,
                "optimize.bytes": report.after.file_bytes,
            },
        )
    return {
        "stage": "optimize",
        "worker": worker(ctx),
        "run_id": run_id,
        "source": source,
        "model": stored.to_json(),
        "preset": config.preset,
        "passes": list(report.log.passes or PRESETS[config.preset]),
        "changed": changed,
        "nodes_before": report.before.nodes,
        "nodes_after": report.after.nodes,
    }


def _data(ctx: StageContext, config: PipelineConfig, model: Path, tmp: Path) -> tuple[Any, Any]:
    """(calibration, evaluation) data for ``model``; random inputs when none is configured."""
    from optimizer_core.data import input_specs, load_npz, random_data

    specs = input_specs(model)
    calib = evald = None
    if config.calibration:
        path = ctx.fetch_file(config.calibration, tmp / "calibration.npz")
        calib = load_npz(path, specs)
    if config.eval_data:
        path = ctx.fetch_file(config.eval_data, tmp / "eval.npz")
        evald = load_npz(path, specs)
    if evald is None:
        evald = calib if calib is not None else random_data(specs, batches=8)
    if calib is None:
        calib = evald
    return calib, evald


def quantize(
    ctx: StageContext,
    config: PipelineConfig,
    exported: Mapping[str, Any],
    optimized: Mapping[str, Any],
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Build every requested variant (or the ``only`` ones: an orchestrator maps one task per
    variant) from the optimized model, each in a child process (:mod:`..isolation`): a
    variant that cannot be built, or whose build crashes or hangs the runtime, is recorded
    with its error; the others go on. Variants judged before (``exported["reused"]``) are not
    built again."""
    from optimizer_core.isolation import map_isolated
    from optimizer_core.quantize.build import QuantizeConfig

    config = config.resolved(ctx)
    require(exported, ("run_id", "source", "model"), "quantize")
    require(optimized, ("model",), "quantize")
    run_id = exported["run_id"]
    source = exported["source"]
    wanted = list(only) if only is not None else list(config.variants)
    stray = [v for v in wanted if v not in config.variants]
    if stray:
        raise PipelineError(
            f"quantize: {', '.join(stray)} not among the config's variants "
            f"({', '.join(config.variants)})"
        )
    known = exported.get("reused") or {}
    reused = [v for v in wanted if v in known]
    wanted = [v for v in wanted if v not in known]
    out: dict[str, Any] = {}
    record = {"stage": "quantize", "run_id": run_id, "source": source, "reused": reused}
    if not wanted:
        return {**record, "variants": out, "worker": worker(ctx)}
    from optimizer_core.runtime import providers_for

    # here, not only in the children: a missing device fails the stage before any work, and
    # what the choice of provider says reaches this stage's log
    providers_for(config.device, tensorrt=config.tensorrt)
    store = ctx.store()
    qconfig = QuantizeConfig(preset=config.preset, tune_device=config.device)
    label = "quantize" if only is None else "quantize." + "-".join(only)
    with _stage(ctx, run_id, "quantize", label=label) as client, ctx.scratch("quantize") as tmp:
        reference = _fetch(ctx, exported, tmp / "reference")
        base = _fetch(ctx, optimized, tmp / "optimized")
        calib, evald = _data(ctx, config, reference, tmp)
        ctx.say(f"quantize: building {', '.join(wanted)}, each in a child process")
        builds = map_isolated(
            "optimizer_core.variants:build_job",
            wanted,
            common={
                "src": str(base),
                "dst_root": str(tmp / "variants"),
                "config": qconfig,
                "calibration": calib.batches,
                "reference": str(reference) if config.fallback else None,
                "data": evald,
                "policy": dict(config.policy) if config.policy is not None else None,
                "device": config.device,
                "tensorrt": config.tensorrt,
                "probe_timeout": min(600.0, ctx.child_timeout),
            },
            timeout=ctx.child_timeout,
            what=lambda v: f"building {v}",
            on_result=lambda i, r: ctx.say(
                f"quantize: {wanted[i]} "
                + (f"failed: {r}" if isinstance(r, BaseException) else "built")
            ),
            on_step=lambda line: ctx.say(f"quantize: {line}"),
        )
        for variant, build in zip(wanted, builds, strict=True):
            if isinstance(build, BaseException):
                logger.warning("quantize: %s could not be built: %s", variant, build)
                out[variant] = {
                    "model": None,
                    "error": redact(f"{type(build).__name__}: {build}"),
                }
                client.set_tag(run_id, f"{T}build_error.{variant}", redact(build)[:5000])
                continue
            dst = tmp / "variants" / variant / "model.onnx"
            stored = store.put_model(
                dst,
                model=source["name"],
                version=source["version"],
                stage=f"variant-{variant}",
                parents=[optimized["model"]["sha256"]],
                config_hash=config.config_hash,
                extra={"variant": variant},
            )
            client.log_dict(run_id, build.to_json(), f"graphtrim/build-{variant}.json")
            out[variant] = {
                "model": stored.to_json(),
                "attempts": len(build.attempts),
                "excluded": build.excluded,
                "accuracy_passed": build.accuracy_passed,
                # the per-output numbers stay in build-<variant>.json: this record is an XCom
                "agreement": (
                    {k: v for k, v in build.agreement.to_json().items() if k != "outputs"}
                    if build.agreement is not None
                    else None
                ),
            }
    return {**record, "variants": out, "worker": worker(ctx)}


def _summary(result: Any) -> dict[str, Any]:
    """The numbers of one variant's gates that lineage tags and promotion need."""
    metrics: dict[str, Any] = {}
    gates: dict[str, str] = {}
    reasons: list[str] = []
    for g in result.gates:
        gates[g.gate] = g.status
        reasons += [f"{g.gate}: {r}" for r in g.reasons]
        m = g.measured
        if g.gate == "latency" and m:
            metrics.update(
                p50_ms=m.get("p50_ms"),
                p95_ms=m.get("p95_ms"),
                speedup=m.get("speedup_p50"),
                reference_p50_ms=(m.get("baseline") or {}).get("p50_ms"),
                # the range of the per-block speedups: promotion needs a win outside it
                speedup_lo=min(m["block_speedups"]) if m.get("block_speedups") else None,
                speedup_hi=max(m["block_speedups"]) if m.get("block_speedups") else None,
            )
        elif g.gate == "accuracy" and m:
            metrics.update(
                max_abs_error=m.get("max_abs_error"),
                cosine=m.get("cosine"),
                top1_agreement=m.get("top1_agreement"),
                metric_drop=m.get("metric_drop"),
            )
        elif g.gate == "size" and m:
            metrics.update(bytes=m.get("bytes"), size_ratio=m.get("ratio"))
    if result.model is not None:
        metrics.setdefault("bytes", result.model.bytes)
        metrics["nodes"] = result.model.nodes
    return {"passed": result.passed, "gates": gates, "metrics": metrics, "reasons": reasons}


def _evaluate_isolated(
    ctx: StageContext,
    config: PipelineConfig,
    reference: Path,
    paths: Mapping[str, Path],
    data: Any,
) -> Any:
    """The gates of ``paths`` in a child process. If that child dies (a runtime crash on one
    variant, a hang), each variant is measured alone in its own child: the one that crashes
    fails with the signal and the step, the others keep their verdicts."""
    from optimizer_core.gates.evaluate import GateResult, ModelInfo, VariantResult
    from optimizer_core.isolation import ChildFailed, map_isolated

    job = {
        "reference": str(reference),
        "policy": dict(config.policy) if config.policy is not None else None,
        "data": data,
        "device": config.device,
        "tensorrt": config.tensorrt,
    }
    todo = {k: str(v) for k, v in paths.items()}
    (together,) = map_isolated(
        "optimizer_core.gates.evaluate:evaluate_job",
        [todo],
        common=job,
        timeout=ctx.child_timeout,
        what=lambda _i: "gates",
        on_step=lambda line: ctx.say(f"validate: {line}"),
    )
    if not isinstance(together, BaseException):
        return together
    if not isinstance(together, ChildFailed):
        raise together
    ctx.say(f"validate: {together}; measuring each variant alone")
    names = list(todo)
    alone = map_isolated(
        "optimizer_core.gates.evaluate:evaluate_job",
        [{n: todo[n]} for n in names],
        common=job,
        timeout=ctx.child_timeout,
        what=lambda item: f"gates of {next(iter(item))}",
    )
    base = next((e for e in alone if not isinstance(e, BaseException)), None)
    if base is None:  # the reference itself cannot be measured
        raise PipelineError(f"validate: no variant could be measured: {alone[0]}")
    base = dataclasses.replace(base, variants=[], latency_samples=dict(base.latency_samples))
    for name, result in zip(names, alone, strict=True):
        if isinstance(result, BaseException):
            info = None
            with contextlib.suppress(Exception):
                info = ModelInfo.of(todo[name])
            base.variants.append(
                VariantResult(name, info, [GateResult("runtime", "error", {}, {}, [str(result)])])
            )
            continue
        base.variants.extend(result.variants)
        base.latency_samples.update(result.latency_samples)
    return base


def validate(
    ctx: StageContext,
    config: PipelineConfig,
    exported: Mapping[str, Any],
    quantized: Mapping[str, Any],
) -> dict[str, Any]:
    """Judge every variant against the exported (unoptimized) model on ``config.device`` and
    write the reports. A variant that was not built fails its ``build`` gate. Every step that
    loads a variant runs in a child process: first the ``serving`` gate (the model saved with
    MLflow's ONNX flavor, loaded with ``mlflow.pyfunc.load_model`` at onnxruntime's default
    optimization level, one prediction), then the accuracy, latency and size gates. Variants
    judged before are reported with their recorded verdicts."""
    from optimizer_core.gates.evaluate import GateResult, ModelInfo, VariantResult
    from optimizer_core.gates.fingerprint import fingerprint_digest
    from optimizer_core.integrations.artifacts import _safe
    from optimizer_core.isolation import map_isolated

    config = config.resolved(ctx)
    require(exported, ("run_id", "source", "model"), "validate")
    require(quantized, ("variants",), "validate")
    run_id = exported["run_id"]
    source = exported["source"]
    known = exported.get("reused") or {}
    reused = {v: {**known[v], "reused": True} for v in quantized.get("reused", []) if v in known}
    subset = list(quantized["variants"])
    record: dict[str, Any] = {
        "stage": "validate",
        "worker": worker(ctx),
        "run_id": run_id,
        "source": source,
        "device": config.device,
    }
    if not subset:  # everything asked of this task was judged before
        return {
            **record,
            "passed": [n for n, s in reused.items() if s["passed"]],
            "variants": reused,
            "reference": None,
            "fingerprint": "",
            "policy_hash": config.gate_policy().digest(),
            "reports": {},
        }
    from optimizer_core.runtime import providers_for

    providers_for(config.device, tensorrt=config.tensorrt)  # as in quantize
    store = ctx.store()
    label = "validate" if set(subset) == set(config.variants) else "validate." + "-".join(subset)
    with _stage(ctx, run_id, "validate", label=label) as client, ctx.scratch("validate") as tmp:
        reference = _fetch(ctx, exported, tmp / "reference")
        _, evald = _data(ctx, config, reference, tmp)
        paths: dict[str, Path] = {}
        for variant, rec in quantized["variants"].items():
            if rec.get("model"):
                paths[variant] = _fetch(ctx, rec, tmp / "variants" / variant)
        serving: dict[str, Any] = {}
        if paths:
            ctx.say(f"validate: serving probe of {', '.join(paths)} (mlflow.pyfunc, child process)")
            probes = map_isolated(
                "optimizer_core.integrations.serving:serving_probe",
                [str(p) for p in paths.values()],
                common={"feeds": evald.batches[0] if evald.batches else None},
                timeout=min(600.0, ctx.child_timeout),
                what=lambda p: f"serving {Path(p).parent.name}",
            )
            for name, probe in zip(paths, probes, strict=True):
                if isinstance(probe, BaseException):
                    serving[name] = GateResult("serving", "error", {}, {}, [str(probe)])
                else:
                    serving[name] = GateResult("serving", "pass", probe, {})
        measurable = {n: p for n, p in paths.items() if serving[n].passed}
        evaluation = _evaluate_isolated(ctx, config, reference, measurable, evald)
        for result in evaluation.variants:
            result.gates.insert(0, serving[result.name])
        for name, path in paths.items():
            if name not in measurable:
                info = None
                with contextlib.suppress(Exception):
                    info = ModelInfo.of(path)
                evaluation.variants.append(VariantResult(name, info, [serving[name]]))
        for variant, rec in quantized["variants"].items():
            if not rec.get("model"):
                evaluation.variants.append(
                    VariantResult(
                        variant,
                        None,
                        [GateResult("build", "error", {}, {}, [rec.get("error", "")])],
                    )
                )
        order = list(quantized["variants"])
        evaluation.variants.sort(key=lambda v: order.index(v.name))
        names = list(quantized["variants"])
        # one task per variant writes its own reports beside the others'
        stem = (
            "evaluation" if set(names) == set(config.variants) else f"evaluation-{'-'.join(names)}"
        )
        reports = evaluation.write(tmp / "reports", stem=stem)
        prefix = "/".join(
            (
                _safe(source["name"]),
                _safe(source["version"]),
                "reports",
                config.config_hash[:16],
                run_id,
            )
        )
        uris = {
            kind: store.put_file(path, f"{prefix}/{path.name}") for kind, path in reports.items()
        }
        client.log_artifacts(run_id, str(tmp / "reports"), "graphtrim/reports")
        variants = {v.name: _summary(v) for v in evaluation.variants}
        for v in evaluation.variants:
            if v.name in quantized["variants"] and quantized["variants"][v.name].get("model"):
                variants[v.name]["model"] = quantized["variants"][v.name]["model"]
        metrics: dict[str, Any] = {}
        for name, s in variants.items():
            metrics[f"{name}.passed"] = 1 if s["passed"] else 0
            metrics.update({f"{name}.{k}": v for k, v in s["metrics"].items()})
        _log_metrics(client, run_id, metrics)
        fp = evaluation.fingerprint
        variants.update(reused)
    return {
        **record,
        "passed": [n for n, s in variants.items() if s["passed"]],
        "variants": variants,
        "reference": {"bytes": evaluation.reference.bytes, "nodes": evaluation.reference.nodes},
        "fingerprint": fingerprint_digest(fp),
        "policy_hash": evaluation.policy_hash,
        "reports": uris,
    }


def merge_validated(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One validate record from several (one per mapped variant task) of the same run."""
    if not records:
        raise PipelineError("no validate records to merge")
    runs = {r["run_id"] for r in records}
    if len(runs) != 1:
        raise PipelineError(
            f"validate records of different pipeline runs: {', '.join(sorted(runs))}"
        )
    merged = dict(records[0])
    for key in ("reference", "fingerprint", "policy_hash"):  # from a task that measured
        merged[key] = next((r[key] for r in records if r.get(key)), merged.get(key))
    merged["variants"] = {}
    merged["reports"] = {}
    for r in records:
        merged["variants"].update(r["variants"])
        for kind, uri in r.get("reports", {}).items():
            merged["reports"].setdefault(kind, uri)
        merged.setdefault("all_reports", []).append(r.get("reports", {}))
        for name in r["variants"]:
            merged.setdefault("workers", {})[name] = r.get("worker")
    merged["passed"] = [n for n, s in merged["variants"].items() if s["passed"]]
    return merged


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


def _log_onnx(
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
    optimized: Mapping[str, Any],
    validated: Mapping[str, Any],
) -> dict[str, Any]:
    """Log every variant that passed its gates as an MLflow ONNX model and register it, with
    lineage tags, as a new version of the target model. Variants that failed are recorded in
    the run, never registered. A variant registered before (same lineage key) is reported,
    not registered again."""
    from optimizer_core.integrations.registry import KEY_TAG

    config = config.resolved(ctx)
    require(validated, ("run_id", "source", "variants"), "register")
    run_id = validated["run_id"]
    source = validated["source"]
    target = config.target_name or source["name"]
    registry = ctx.registry()
    versions = json.dumps(library_versions(), sort_keys=True)
    registered: dict[str, Any] = {}
    failed: dict[str, list[str]] = {}
    with _stage(ctx, run_id, "register") as client, ctx.scratch("register") as tmp:
        experiment_id = client.get_run(run_id).info.experiment_id
        for variant, summary in validated["variants"].items():
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
                T + "passes": ",".join(optimized.get("passes", [])),
                T + "config_hash": config.config_hash,
                T + "gates": json.dumps(summary["gates"], sort_keys=True),
                T + "metrics": json.dumps(
                    {k: v for k, v in summary["metrics"].items() if v is not None}, sort_keys=True
                ),
                T + "fingerprint": validated.get("fingerprint", ""),
                T + "device": validated.get("device", config.device),
                T + "versions": versions,
                T + "pipeline_run_id": run_id,
                T + "orchestrator_run_id": ctx.orchestrator_run_id or "",
                T + "artifact": summary["model"]["uri"],
                T + "sha256": summary["model"]["sha256"],
            }
            logged = _logged_model(client, experiment_id, key)
            if logged is None:
                ctx.say(f"register: logging {variant}")
                path = _fetch(ctx, summary, tmp / variant)
                model_uri = _log_onnx(
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
    return {
        "stage": "register",
        "worker": worker(ctx),
        "run_id": run_id,
        "source": source,
        "target": target,
        "registered": registered,
        "failed": failed,
    }


def promote(
    ctx: StageContext,
    config: PipelineConfig,
    validated: Mapping[str, Any],
    registered: Mapping[str, Any],
) -> dict[str, Any]:
    """Move aliases by the policy's ``promotion`` section (see :mod:`.promote`)."""
    from optimizer_core.stages.promote import apply_policy

    require(registered, ("run_id", "target", "registered"), "promote")
    run_id = registered["run_id"]
    with _stage(ctx, run_id, "promote", last=True) as client:
        result = apply_policy(
            ctx.registry(),
            config.gate_policy().promotion,
            target=registered["target"],
            source=registered["source"],
            validated=validated,
            registered=registered["registered"],
            why=f"graphtrim pipeline run {run_id}",
            force=ctx.force_promotion,
        )
        client.log_dict(run_id, result, "graphtrim/promotion.json")
        champion = result.get("champion") or {}
        client.set_tag(run_id, T + "champion", json.dumps(champion, sort_keys=True)[:5000])
    return {"stage": "promote", "run_id": run_id, **result, "worker": worker(ctx)}


def run_pipeline(ctx: StageContext, config: PipelineConfig, model_uri: str) -> dict[str, Any]:
    """All stages in order, in this process; returns every stage's record."""
    config = config.resolved(ctx)
    records: dict[str, Any] = {}
    records["export"] = export(ctx, config, model_uri)
    records["optimize"] = optimize(ctx, config, records["export"])
    records["quantize"] = quantize(ctx, config, records["export"], records["optimize"])
    records["validate"] = validate(ctx, config, records["export"], records["quantize"])
    records["register"] = register(ctx, config, records["optimize"], records["validate"])
    records["promote"] = promote(ctx, config, records["validate"], records["register"])
    return records
