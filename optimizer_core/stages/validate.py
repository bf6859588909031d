"""The validate stage: judge each variant against the exported (unoptimized) model with every
gate, and write the JSON, Markdown and HTML reports.

The pipeline judges the stored variants, each step that loads one in a child process
(:func:`validate`); ``graphtrim variants`` judges the variants it built in this process
(:func:`judge_variants`). Both add a failed ``build`` gate for a variant that was not built and
keep the order the variants were asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphtrim.stages.context import DataFiles, PipelineConfig, PipelineError, StageContext
from graphtrim.stages.records import ExportRecord, QuantizeRecord, ValidateRecord
from graphtrim.stages.tracking import log_metrics, publish_reports, stage_run, worker

if TYPE_CHECKING:
    from graphtrim.data import EvalData
    from graphtrim.gates.policy import GatePolicy
    from graphtrim.gates.verdicts import Evaluation


def summary(result: Any) -> dict[str, Any]:
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
            if m.get("decode"):  # a language model: the judged step is a decode step
                metrics.update(
                    decode_tokens_per_s=m["decode"].get("tokens_per_s"),
                    prefill_p50_ms=(m.get("prefill") or {}).get("p50_ms"),
                    prefill_speedup=(m.get("prefill") or {}).get("speedup_p50"),
                )
        elif g.gate == "accuracy" and m:
            metrics.update(
                max_abs_error=m.get("max_abs_error"),
                cosine=m.get("cosine"),
                top1_agreement=m.get("top1_agreement"),
                metric_drop=m.get("metric_drop"),
            )
            if m.get("reference_perplexity") is not None:
                metrics.update(
                    perplexity=m.get("variant_perplexity"),
                    reference_perplexity=m.get("reference_perplexity"),
                    perplexity_ratio=m.get("perplexity_ratio"),
                    greedy_match=m.get("greedy_match"),
                )
        elif g.gate == "size" and m:
            metrics.update(bytes=m.get("bytes"), size_ratio=m.get("ratio"))
    if result.model is not None:
        metrics.setdefault("bytes", result.model.bytes)
        metrics["nodes"] = result.model.nodes
    return {"passed": result.passed, "gates": gates, "metrics": metrics, "reasons": reasons}


def add_unbuilt(evaluation: Evaluation, failed: Mapping[str, str], order: Sequence[str]) -> None:
    """A failed ``build`` gate for each variant in ``failed`` (with why it was not built), and
    the variants sorted as in ``order``."""
    from graphtrim.gates.verdicts import GateResult, VariantResult

    for variant, reason in failed.items():
        evaluation.variants.append(
            VariantResult(variant, None, [GateResult("build", "error", {}, {}, [reason])])
        )
    evaluation.variants.sort(key=lambda v: list(order).index(v.name))


def judge_variants(
    src: Path,
    outputs: Mapping[str, Path],
    failed: Mapping[str, str],
    order: Sequence[str],
    *,
    policy: GatePolicy,
    data: EvalData,
    builds: Mapping[str, dict[str, Any]] | None = None,
    device: str = "cpu",
    tensorrt: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Evaluation:
    """Every gate on the built variants ``outputs`` against ``src``, in this process; the
    variants in ``failed`` fail their ``build`` gate."""
    from graphtrim.gates.evaluate import evaluate

    evaluation = evaluate(
        src,
        dict(outputs),
        policy=policy,
        data=data,
        device=device,
        tensorrt=tensorrt,
        builds=dict(builds or {}),
        progress=progress,
    )
    add_unbuilt(evaluation, failed, order)
    return evaluation


def evaluate_isolated(
    ctx: StageContext,
    config: PipelineConfig,
    reference: Path,
    paths: Mapping[str, Path],
    data: Any,
    *,
    together_max_bytes: int | None = None,
    unreached: set[str] | None = None,
) -> Any:
    """The gates of ``paths`` in a child process. If that child dies (a runtime crash on one
    variant, a hang), each variant is measured alone in its own child: the one that crashes
    fails with the signal and the step, the others keep their verdicts.

    Memory: measured together, every variant's session is open beside the reference's, so the
    child's memory is their sum. Variants that hold more than ``together_max_bytes`` (on disk;
    default :data:`graphtrim.gates.evaluate.MAX_OPEN_BYTES`) together with the reference are
    each measured beside the reference in a child of their own, one after the other; where the
    reference and one variant are above it too (a language model's fp32 export and its fp32
    graph variant), that child opens one session at a time and the latency runs take turns
    block by block. The peak is then the largest model's session.

    ``unreached`` receives the variants whose measurement was not reached (:func:`reached`
    is false for what ended it): their failure is no verdict on the model."""
    from graphtrim.gates.evaluate import MAX_OPEN_BYTES
    from graphtrim.gates.verdicts import GateResult, ModelInfo, VariantResult
    from graphtrim.isolation import ChildFailed, map_isolated

    if together_max_bytes is None:
        together_max_bytes = MAX_OPEN_BYTES

    job = {
        "reference": str(reference),
        "policy": config.gate_policy(),
        "data": data,
        "device": config.device,
        "tensorrt": config.tensorrt,
        "max_open_bytes": together_max_bytes,
    }
    todo = {k: str(v) for k, v in paths.items()}
    total = ModelInfo.file_bytes(reference)
    for path in todo.values():
        with contextlib.suppress(OSError):
            total += ModelInfo.file_bytes(path)
    lean = len(todo) > 1 and total > together_max_bytes
    if lean:
        ctx.say(
            f"validate: {len(todo)} variants and the reference hold {total / 2**30:.2f} GiB; "
            "each variant is measured beside the reference alone, so that one variant at a time "
            "is in memory"
        )
    else:
        (together,) = map_isolated(
            "graphtrim.gates.evaluate:evaluate_job",
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
    names = list(todo)
    if not lean and len(names) == 1:  # measured alone already: the same child again
        alone: list[Any] = [together]
    else:
        if not lean:
            ctx.say(f"validate: {together}; measuring each variant alone")
        alone = map_isolated(
            "graphtrim.gates.evaluate:evaluate_job",
            [{n: todo[n]} for n in names],
            common=job,
            timeout=ctx.child_timeout,
            what=lambda item: f"gates of {next(iter(item))}",
            on_step=lambda line: ctx.say(f"validate: {line}"),
            # a child per variant, whose memory goes back to the system before the next one
            fresh=lean,
        )
    base = next((e for e in alone if not isinstance(e, BaseException)), None)
    if base is None and not all(isinstance(e, BaseException) and not reached(e) for e in alone):
        # the reference itself cannot be measured
        raise PipelineError(f"validate: no variant could be measured: {alone[0]}")
    if base is None:  # nothing was reached: the reference's numbers stay unknown
        from graphtrim.gates.verdicts import Evaluation

        policy = config.gate_policy()
        base = Evaluation(
            reference=ModelInfo.of(reference),
            device=config.device,
            variants=[],
            fingerprint={},
            policy=policy.to_json(),
            policy_hash=policy.digest(),
            data_source="",
            latency_samples={},
            started="",
            seconds=0.0,
        )
    base = dataclasses.replace(base, variants=[], latency_samples=dict(base.latency_samples))
    for name, result in zip(names, alone, strict=True):
        if isinstance(result, BaseException):
            if not reached(result) and unreached is not None:
                unreached.add(name)
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


# signals a process gets from outside (a timeout's kill, the OOM killer, a worker shut
# down): the model was not judged. A fatal signal of its own (SIGSEGV, SIGABRT, SIGBUS,
# SIGFPE, SIGILL) is a defect the model reproduces: a measured failure.
_FROM_OUTSIDE = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def reached(exc: BaseException) -> bool:
    """Whether the failure ``exc`` of a child that built or measured a variant is a verdict
    on the model (it ran and failed) rather than a measurement not reached: a timeout, a
    child killed from outside, a transient error (a lost connection)."""
    from graphtrim.isolation import ChildFailed

    if isinstance(exc, ChildFailed):
        return not (exc.timed_out or exc.signal_name in _FROM_OUTSIDE)
    return not getattr(exc, "transient", False)


def validate(
    ctx: StageContext,
    config: PipelineConfig,
    exported: ExportRecord | Mapping[str, Any],
    quantized: QuantizeRecord | Mapping[str, Any],
) -> ValidateRecord:
    """Judge every variant against the exported (unoptimized) model on ``config.device`` and
    write the reports. A variant that was not built fails its ``build`` gate. Every step that
    loads a variant runs in a child process: first the ``serving`` gate (the model saved with
    MLflow's ONNX flavor, loaded with ``mlflow.pyfunc.load_model`` at onnxruntime's default
    optimization level, one prediction), then the accuracy, latency and size gates. Variants
    judged before are reported with their recorded verdicts."""
    from graphtrim.gates.fingerprint import fingerprint_digest
    from graphtrim.gates.verdicts import GateResult, ModelInfo, VariantResult
    from graphtrim.isolation import map_isolated

    with ctx.scratch("validate") as tmp:
        data = DataFiles(ctx, config, tmp / "data")
        config = config.resolved(ctx, data)
        exp = ExportRecord.take(exported, ("run_id", "source", "model"), "validate")
        quant = QuantizeRecord.take(quantized, ("variants",), "validate")
        run_id = exp.run_id
        source = exp.source
        known = exp.reused or {}
        reused = {v: {**known[v], "reused": True} for v in quant.reused if v in known}
        subset = list(quant.variants)
        record = ValidateRecord(
            worker=worker(ctx), run_id=run_id, source=source, device=config.device
        )
        if not subset:  # everything asked of this task was judged before
            record.passed = [n for n, s in reused.items() if s["passed"]]
            record.variants = reused
            record.policy_hash = config.gate_policy().digest()
            return record
        from graphtrim.runtime import providers_for

        providers_for(config.device, tensorrt=config.tensorrt)  # as in quantize
        store = ctx.store()
        label = (
            "validate" if set(subset) == set(config.variants) else "validate." + "-".join(subset)
        )
        assert exp.model is not None
        with stage_run(ctx, run_id, "validate", label=label) as mlflow:
            reference = ctx.fetch(exp.model["uri"], tmp / "reference")
            _, evald = data.load(reference)
            paths: dict[str, Path] = {}
            for variant, rec in quant.variants.items():
                if rec.get("model"):
                    paths[variant] = ctx.fetch(rec["model"]["uri"], tmp / "variants" / variant)
            serving: dict[str, Any] = {}
            # variants whose build or measurement was not reached: no verdict on the model
            unreached = {v for v, rec in quant.variants.items() if rec.get("reached") is False}
            if paths:
                ctx.say(
                    f"validate: serving probe of {', '.join(paths)} (mlflow.pyfunc, child process)"
                )
                probes = map_isolated(
                    "graphtrim.integrations.serving:serving_probe",
                    [str(p) for p in paths.values()],
                    common={"feeds": evald.batches[0] if evald.batches else None},
                    timeout=min(600.0, ctx.child_timeout),
                    what=lambda p: f"serving {Path(p).parent.name}",
                )
                for name, probe in zip(paths, probes, strict=True):
                    if isinstance(probe, BaseException):
                        serving[name] = GateResult("serving", "error", {}, {}, [str(probe)])
                        if not reached(probe):
                            unreached.add(name)
                    else:
                        serving[name] = GateResult("serving", "pass", probe, {})
            measurable = {n: p for n, p in paths.items() if serving[n].passed}
            evaluation = evaluate_isolated(
                ctx, config, reference, measurable, evald, unreached=unreached
            )
            for result in evaluation.variants:
                result.gates.insert(0, serving[result.name])
            for name, path in paths.items():
                if name not in measurable:
                    info = None
                    with contextlib.suppress(Exception):
                        info = ModelInfo.of(path)
                    evaluation.variants.append(VariantResult(name, info, [serving[name]]))
            names = list(quant.variants)
            add_unbuilt(
                evaluation,
                {
                    v: rec.get("error", "")
                    for v, rec in quant.variants.items()
                    if not rec.get("model")
                },
                names,
            )
            # one task per variant writes its own reports beside the others'
            stem = (
                "evaluation"
                if set(names) == set(config.variants)
                else f"evaluation-{'-'.join(names)}"
            )
            # the reports name the reference as the registry does, not by its temporary file
            evaluation.reference.path = f"models:/{source['name']}/{source['version']}"
            reports = evaluation.write(tmp / "reports", stem=stem)
            uris = publish_reports(store, mlflow, run_id, source, config.config_hash, reports)
            variants = {v.name: summary(v) for v in evaluation.variants}
            for name in unreached & set(variants):
                variants[name]["measured"] = False
            for v in evaluation.variants:
                if v.name in quant.variants and quant.variants[v.name].get("model"):
                    variants[v.name]["model"] = quant.variants[v.name]["model"]
                    for key in ("conversion", "tuning"):  # what register tags it with
                        if quant.variants[v.name].get(key):
                            variants[v.name][key] = quant.variants[v.name][key]
            metrics: dict[str, Any] = {}
            for name, s in variants.items():
                metrics[f"{name}.passed"] = 1 if s["passed"] else 0
                metrics.update({f"{name}.{k}": v for k, v in s["metrics"].items()})
            log_metrics(mlflow, run_id, metrics)
            fp = evaluation.fingerprint
            variants.update(reused)
    record.passed = [n for n, s in variants.items() if s["passed"]]
    record.variants = variants
    record.reference = {"bytes": evaluation.reference.bytes, "nodes": evaluation.reference.nodes}
    record.fingerprint = fingerprint_digest(fp)
    record.policy_hash = evaluation.policy_hash
    record.reports = uris
    return record
