"""Build the requested variants of a model and judge them all: what a pipeline's quantize and
validate stages do, in one call.

Each variant is built from the source (graph-optimized first, verified); int8 and fp16 variants
that fail their accuracy gate are rebuilt with their most sensitive nodes in float, within the
budget of attempts. Then every variant goes through every gate against the unmodified source,
and the JSON, Markdown and HTML reports are written beside the variants.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from optimizer_core.data import EvalData, input_specs, load_npz, random_data
from optimizer_core.gates import accuracy as acc
from optimizer_core.gates.evaluate import Evaluation, evaluate
from optimizer_core.gates.policy import GatePolicy
from optimizer_core.quantize.build import VARIANTS, QuantizeConfig, QuantizeError, build_variant
from optimizer_core.runtime import open_session, providers_for

ProgressFn = Callable[[str], None]


@dataclasses.dataclass
class VariantsResult:
    evaluation: Evaluation
    outputs: dict[str, Path]
    reports: dict[str, Path]

    @property
    def passed(self) -> list[str]:
        return self.evaluation.passed


def accuracy_check(
    reference: str | os.PathLike[str],
    data: EvalData,
    policy: GatePolicy,
    variant: str,
    *,
    device: str = "cpu",
    tensorrt: bool = False,
) -> Callable[[Path], tuple[bool, dict[str, Any]]]:
    """The accuracy gate of ``variant`` as a callable on a candidate file (for the fallback)."""
    thresholds = policy.for_variant(variant).accuracy
    providers = providers_for(device, tensorrt=tensorrt)
    ref = open_session(reference, device=device, providers=providers)
    cache: dict[str, Any] = {}

    def check(path: Path) -> tuple[bool, dict[str, Any]]:
        if thresholds is None:
            return True, {}
        key = thresholds.output or ""
        if key not in cache:
            cache[key] = acc.run_outputs(ref, data, thresholds.output)
        cand = open_session(path, device=device, providers=providers)
        m = acc.measure(ref, cand, data, metric=thresholds.metric, reference_outputs=cache[key])
        broken = acc.judge(m, thresholds)
        return not broken, {**m.to_json(), "broken": broken}

    return check


def build_and_evaluate(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    variants: Sequence[str] = ("graph", "int8-dynamic", "int8-static"),
    *,
    config: QuantizeConfig | None = None,
    calibration: str | os.PathLike[str] | None = None,
    eval_data: str | os.PathLike[str] | None = None,
    policy: GatePolicy | None = None,
    device: str = "cpu",
    tensorrt: bool = False,
    batch_size: int = 32,
    label_key: str = "labels",
    fallback: bool = True,
    progress: ProgressFn | None = None,
) -> VariantsResult:
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise QuantizeError(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    src = Path(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy or GatePolicy()
    providers_for(device, tensorrt=tensorrt)  # a missing GPU is an error before any work
    specs = input_specs(src)
    calib = (
        load_npz(calibration, specs, batch_size=batch_size, label_key=label_key)
        if calibration is not None
        else None
    )
    if eval_data is not None:
        data = load_npz(eval_data, specs, batch_size=batch_size, label_key=label_key)
    elif calib is not None:
        data = calib
    else:
        data = random_data(specs, batches=8)
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
                calibration=calib.batches if calib is not None else None,
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
    evaluation = evaluate(
        src,
        outputs,
        policy=policy,
        data=data,
        device=device,
        tensorrt=tensorrt,
        builds=builds,
        progress=progress,
    )
    from optimizer_core.gates.evaluate import GateResult, VariantResult

    for variant, reason in failed.items():
        evaluation.variants.append(
            VariantResult(variant, None, [GateResult("build", "error", {}, {}, [reason])])
        )
    order = list(variants)
    evaluation.variants.sort(key=lambda v: order.index(v.name))
    reports = evaluation.write(out, stem=f"{src.stem}.evaluation")
    return VariantsResult(evaluation, outputs, reports)


def build_job(variant: str, **job: Any) -> Any:
    """One variant's build as a child process runs it (:mod:`optimizer_core.isolation`): the
    accuracy check is made here from plain values, since a callable cannot cross processes.

    ``job``: ``src``, ``dst_root`` (the variant goes to ``dst_root/<variant>/model.onnx``),
    ``config`` (:class:`QuantizeConfig`), ``calibration`` (feeds),
    ``reference`` (the model the accuracy check compares with; None: no fallback), ``data``
    (:class:`EvalData`), ``policy`` (a policy document or None), ``device``, ``tensorrt``,
    ``probe_timeout``. Returns the :class:`VariantBuild`."""
    from optimizer_core.isolation import step

    policy = GatePolicy(job["policy"], source="pipeline policy") if job["policy"] else GatePolicy()
    check = None
    if job["reference"] is not None:
        step(f"opening the reference model for {variant}'s accuracy check")
        check = accuracy_check(
            job["reference"],
            job["data"],
            policy,
            variant,
            device=job["device"],
            tensorrt=job["tensorrt"],
        )
    step(f"building {variant}")
    return build_variant(
        job["src"],
        Path(job["dst_root"]) / variant / "model.onnx",
        variant,
        config=job["config"],
        calibration=job["calibration"],
        accuracy_check=check,
        progress=step,  # the parent relays each line as progress
        probe_timeout=job["probe_timeout"],
    )
