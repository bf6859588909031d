"""The quantize stage: build the requested variants of the optimized model.

Each variant is built from the graph-optimized model; int8 and fp16 variants that fail their
accuracy gate are rebuilt with their most sensitive nodes in float, within the budget of
attempts. With ``tune`` in the config, each requested kind's settings are searched first
(:mod:`graphtrim.tune`, over that kind's knobs, ``tune`` seconds each; an orchestrator that maps
a task per variant runs the searches on as many workers): the champion is the variant, and a
kind whose search finds none is built with its fixed recipe. The pipeline builds each variant
in a child process (:func:`build_job`) and stores it; ``graphtrim variants`` builds them in
this process (:func:`build_variants`) beside its input.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.redact import redact
from graphtrim.stages.context import DataFiles, PipelineConfig, PipelineError, StageContext
from graphtrim.stages.quantize_tune import (
    _tuned,
)
from graphtrim.stages.records import ExportRecord, OptimizeRecord, QuantizeRecord
from graphtrim.stages.tracking import T, stage_run, worker

if TYPE_CHECKING:
    from graphtrim.data import EvalData
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.quantize.build import QuantizeConfig

logger = logging.getLogger("graphtrim.stages")

ProgressFn = Callable[[str], None]


def build_variants(
    src: Path,
    out: Path,
    variants: Sequence[str],
    *,
    config: QuantizeConfig | None,
    calibration: EvalData | None,
    data: EvalData,
    policy: GatePolicy,
    device: str = "cpu",
    tensorrt: bool = False,
    fallback: bool = True,
    progress: ProgressFn | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Path], dict[str, str]]:
    """Build ``variants`` of ``src`` in this process, each to ``out/<stem>.<variant>.onnx``,
    checked (``fallback``) against ``src`` on ``data``. Returns (builds: each built variant's
    build summary, outputs: its file, failed: each variant that could not be built, with why);
    a variant that cannot be built does not stop the others."""
    from graphtrim.gates.accuracy import accuracy_check
    from graphtrim.quantize.build import QuantizeError, build_variant

    builds: dict[str, dict[str, Any]] = {}
    outputs: dict[str, Path] = {}
    failed: dict[str, str] = {}
    for variant in variants:
        dst = out / f"{src.stem}.{variant}.onnx"
        check = (
            accuracy_check(src, data, policy, variant, device=device, tensorrt=tensorrt)
            if fallback
            else None
        )
        try:
            build = build_variant(
                src,
                dst,
                variant,
                config=config,
                calibration=calibration.batches if calibration is not None else None,
                accuracy_check=check,
                progress=progress,
            )
        except QuantizeError as exc:  # this variant cannot be built or served: the others go on
            failed[variant] = str(exc)
            if progress is not None:
                progress(f"{variant}: not built: {exc}")
            continue
        builds[variant] = build.to_json()
        outputs[variant] = dst
    return builds, outputs, failed


def build_job(variant: str, **job: Any) -> Any:
    """One variant's build as a child process runs it (:mod:`graphtrim.isolation`): the
    accuracy check is made here from plain values, since a callable cannot cross processes.

    ``job``: ``src``, ``dst_root`` (the variant goes to ``dst_root/<variant>/model.onnx``),
    ``config`` (:class:`QuantizeConfig`), ``calibration`` (feeds),
    ``reference`` (the model the accuracy check compares with; None: no fallback), ``data``
    (:class:`EvalData`), ``policy`` (the parsed :class:`GatePolicy`, a policy document, or
    None for the built-in policy), ``device``, ``tensorrt``, ``probe_timeout``. Returns the
    :class:`VariantBuild`."""
    from graphtrim.gates.accuracy import accuracy_check
    from graphtrim.isolation import step
    from graphtrim.quantize.build import build_variant
    from graphtrim.stages.context import parse_policy

    policy = job["policy"]
    if policy is None or isinstance(policy, Mapping):
        policy = parse_policy(policy)
    check = None
    if job["reference"] is not None:
        step(f"reading the reference model's inputs for {variant}'s accuracy check")
        check = accuracy_check(
            job["reference"],
            job["data"],
            policy,
            variant,
            device=job["device"],
            tensorrt=job["tensorrt"],
        )
    step(f"building {variant}")
    dst = Path(job["dst_root"]) / variant / "model.onnx"
    return build_variant(
        job["src"],
        dst,
        variant,
        config=job["config"],
        calibration=job["calibration"],
        accuracy_check=check,
        progress=step,  # the parent relays each line as progress
        probe_timeout=job["probe_timeout"],
    )


def quantize(
    ctx: StageContext,
    config: PipelineConfig,
    exported: ExportRecord | Mapping[str, Any],
    optimized: OptimizeRecord | Mapping[str, Any],
    only: Sequence[str] | None = None,
    tuned: Mapping[str, Any] | None = None,
) -> QuantizeRecord:
    """Build every requested variant (or the ``only`` ones: an orchestrator maps one task per
    variant) from the optimized model, each in a child process (:mod:`..isolation`): a
    variant that cannot be built, or whose build crashes or hangs the runtime, is recorded
    with its error; the others go on. Variants judged before (``exported.reused``) are not
    built again. ``tuned``: the settings search an orchestrator ran over its workers
    (:mod:`graphtrim.stages.tune`), whose best trials this stage judges."""
    from graphtrim.isolation import map_isolated
    from graphtrim.quantize.build import QuantizeConfig

    with ctx.scratch("quantize") as tmp:
        data = DataFiles(ctx, config, tmp / "data")
        config = config.resolved(ctx, data)
        exp = ExportRecord.take(exported, ("run_id", "source", "model"), "quantize")
        opt = OptimizeRecord.take(optimized, ("model",), "quantize")
        run_id = exp.run_id
        source = exp.source
        wanted = list(only) if only is not None else list(config.variants)
        stray = [v for v in wanted if v not in config.variants]
        if stray:
            raise PipelineError(
                f"quantize: {', '.join(stray)} not among the config's variants "
                f"({', '.join(config.variants)})"
            )
        known = exp.reused or {}
        reused = [v for v in wanted if v in known]
        wanted = [v for v in wanted if v not in known]
        record = QuantizeRecord(run_id=run_id, source=source, reused=reused)
        if not wanted:
            record.worker = worker(ctx)
            return record
        from graphtrim.runtime import providers_for

        # here, not only in the children: a missing device fails the stage before any work,
        # and what the choice of provider says reaches this stage's log
        providers_for(config.device, tensorrt=config.tensorrt)
        store = ctx.store()
        qconfig = QuantizeConfig(
            preset=config.preset, tune_device=config.device, **(config.weights or {})
        )
        label = "quantize" if only is None else "quantize." + "-".join(only)
        assert exp.model is not None and opt.model is not None
        with stage_run(ctx, run_id, "quantize", label=label) as mlflow:
            reference = ctx.fetch(exp.model["uri"], tmp / "reference")
            base = ctx.fetch(opt.model["uri"], tmp / "optimized")
            calib, evald = data.load(reference)
            if config.tune is not None:
                wanted = _tuned(
                    ctx,
                    config,
                    record,
                    mlflow,
                    store,
                    qconfig,
                    wanted,
                    base,
                    tmp,
                    calib,
                    evald,
                    source,
                    run_id,
                    opt,
                    tuned,
                )
            if not wanted:
                record.worker = worker(ctx)
                return record
            ctx.say(f"quantize: building {', '.join(wanted)}, each in a child process")
            builds = map_isolated(
                "graphtrim.stages.quantize:build_job",
                wanted,
                common={
                    "src": str(base),
                    "dst_root": str(tmp / "variants"),
                    "config": qconfig,
                    "calibration": calib.batches,
                    "reference": str(reference) if config.fallback else None,
                    "data": evald,
                    "policy": config.gate_policy(),
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
                # a process per variant: what one build held is not held through the next
                fresh=True,
            )
            for variant, build in zip(wanted, builds, strict=True):
                if isinstance(build, BaseException):
                    logger.warning("quantize: %s could not be built: %s", variant, build)
                    from graphtrim.stages.validate import reached

                    record.variants[variant] = {
                        "model": None,
                        "error": redact(f"{type(build).__name__}: {build}"),
                    }
                    if not reached(build):  # a timeout, a kill: no verdict on the model
                        record.variants[variant]["reached"] = False
                    mlflow.set_tag(run_id, f"{T}build_error.{variant}", redact(build)[:5000])
                    continue
                dst = tmp / "variants" / variant / "model.onnx"
                stored = store.put_model(
                    dst,
                    model=source["name"],
                    version=source["version"],
                    stage=f"variant-{variant}",
                    parents=[opt.model["sha256"]],
                    config_hash=config.config_hash,
                    extra={"variant": variant},
                )
                mlflow.log_dict(run_id, build.to_json(), f"graphtrim/build-{variant}.json")
                record.variants[variant] = {
                    "model": stored.to_json(),
                    "attempts": len(build.attempts),
                    "excluded": build.excluded,
                    "accuracy_passed": build.accuracy_passed,
                    # what the converter did (weight-only: bits, block, form, ...)
                    "conversion": build.conversion,
                    # the per-output numbers stay in build-<variant>.json: this record is an XCom
                    "agreement": (
                        {k: v for k, v in build.agreement.to_json().items() if k != "outputs"}
                        if build.agreement is not None
                        else None
                    ),
                }
    record.worker = worker(ctx)
    return record
