"""onnxruntime's offline fusions for the ``ort-cpu`` / ``ort-cuda`` targets, kept only where timing
on the target's provider shows they help (see :mod:`graphtrim.graph.targets` for the profiles).

This writes files and times onnxruntime sessions, so it sits above the graph layer: the file-level
optimizer (:func:`graphtrim.optimize_file.optimize_file`) applies it after the passes.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx_ir as ir

from graphtrim.errors import GraphtrimError
from graphtrim.graph import _ir_utils as u
from graphtrim.graph.optimizer import OptimizeResult
from graphtrim.graph.targets import record_metadata

ORT_TARGETS = ("ort-cpu", "ort-cuda")

# a fused model within this fraction of the portable model's p50 counts as not slower
NOISE_MARGIN = 0.02

_PROVIDERS = {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}


def _provider(target: str) -> str:
    import onnxruntime as ort

    from graphtrim.runtime import GPU_ON_CPU_ENV, providers_for

    provider = _PROVIDERS[target]
    if provider == "CPUExecutionProvider":
        return provider
    chosen = providers_for("gpu")[0]  # raises without CUDA unless the test escape is set
    if chosen != provider:
        import logging

        logging.getLogger("graphtrim.optimizer").warning(
            "target %s fused for %s because %s=1 (no CUDA in onnxruntime %s)",
            target,
            chosen,
            GPU_ON_CPU_ENV,
            ort.__version__,
        )
    return chosen


def _p50s(
    paths: list[Path],
    provider: str,
    runs: int,
    threads: int,
    feeds: Mapping[str, Any] | None = None,
) -> tuple[list[float], list[float]]:
    """Load time and interleaved p50 latency (seconds) of each model, as deployed. The order
    of the models rotates from round to round, so no model always runs first."""
    import onnxruntime as ort

    from graphtrim.runtime import session_options
    from graphtrim.verify.inputs import make_inputs

    sessions, loads = [], []
    for path in paths:
        start = time.perf_counter()
        sessions.append(
            ort.InferenceSession(str(path), session_options(threads), providers=[provider])
        )
        loads.append(time.perf_counter() - start)
    if feeds is None:
        specs = [(i.name, i.type, list(i.shape)) for i in sessions[0].get_inputs()]
        feeds = make_inputs(specs, seed=0)
    feeds = dict(feeds)
    times: list[list[float]] = [[] for _ in sessions]
    for s in sessions:  # warm-up
        s.run(None, feeds)
    order = list(range(len(sessions)))
    for r in range(runs):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            sessions[k].run(None, feeds)
            times[k].append(time.perf_counter() - start)
    return loads, [statistics.median(t) for t in times]


def tune_residual_sum(
    path: str | os.PathLike[str],
    provider: str = "CPUExecutionProvider",
    *,
    feeds: Mapping[str, Any] | None = None,
    runs: int = 30,
    threads: int = 1,
) -> dict[str, Any]:
    """Rewrite the model file at ``path`` with ``residual-sum`` when that makes it measurably
    faster on ``provider`` (as deployed, onnxruntime's optimizations on); the record says what
    was measured and what was kept. The file is replaced only by a complete new one."""
    from graphtrim.graph.passes.residual import ResidualSum
    from graphtrim.modelio import load_model, publish_model, save_model

    target = Path(path)
    model = load_model(target)
    if not ResidualSum()(model).modified:
        return {"rewrite": "residual-sum", "kept": "original", "why": "nothing to rewrite"}
    with tempfile.TemporaryDirectory(prefix=".graphtrim-tune-", dir=target.parent) as tmp:
        candidate = Path(tmp) / target.name
        save_model(model, candidate)
        del model
        _, p50 = _p50s([target, candidate], provider, runs, threads, feeds)
        faster = p50[1] < p50[0] * (1 - NOISE_MARGIN)
        record: dict[str, Any] = {
            "rewrite": "residual-sum",
            "provider": provider,
            "p50_ms": {"original": p50[0] * 1e3, "rewritten": p50[1] * 1e3},
            "kept": "rewritten" if faster else "original",
        }
        if faster:
            from graphtrim.errors import VerificationError
            from graphtrim.verify import Tolerance, verify

            check = verify(
                target,
                candidate,
                inputs=[dict(feeds)] if feeds is not None else None,
                tolerance=Tolerance(rtol=0.0, atol=0.0, min_cosine=0.0),
            )
            if not check.ok:
                raise VerificationError(
                    f"residual-sum changed results: {check.summary()}",
                    pass_name="residual-sum",
                    record=check,
                )
            publish_model(candidate, target)
        else:
            record["why"] = (
                f"rewritten model ran at {p50[1] * 1e3:.3f} ms p50 against "
                f"{p50[0] * 1e3:.3f} ms: not faster by the {NOISE_MARGIN:.0%} margin"
            )
    return record


def _flipped_residuals(path: Path) -> tuple[ir.Model | None, str]:
    """The model at ``path`` with its residual sums in front of normalizations in the other
    form, and the rewrite's name; ``None`` where there is none to rewrite. A model with both
    forms gets its ``Add`` written as ``Sum``."""
    from graphtrim.graph.passes.residual import ResidualAdd, ResidualSum
    from graphtrim.modelio import load_model

    for rewrite in (ResidualSum, ResidualAdd):
        model = load_model(path)  # a copy, its weights mapped from the file's folder
        if rewrite()(model).modified:
            return model, rewrite.name
    return None, ""


def _writing_options(dst: Path, level: Any) -> Any:
    """Session options that optimize at ``level`` and write the optimized model to ``dst``
    (weights over 1 KiB beside it in ``<name>.data``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", dst.name + ".data"
    )
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )
    return so


def _fuse(src: Path, dst: Path, provider: str, target: str) -> None:
    """onnxruntime's offline fusions (extended level) of the model at ``src`` into ``dst``."""
    import onnxruntime as ort

    so = _writing_options(dst, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    try:
        ort.InferenceSession(str(src), so, providers=[provider])
    except Exception as exc:
        raise GraphtrimError(
            f"onnxruntime could not fuse the model for {target}: {str(exc).splitlines()[0]}"
        ) from exc


def apply_ort_target(
    model: ir.Model, target: str, *, runs: int = 30, threads: int = 1
) -> tuple[ir.Model, dict[str, Any]]:
    """``model`` with onnxruntime's offline fusions for ``target`` when they do not slow it down,
    and the record of what was done.

    Candidates, timed interleaved on the target's provider: the portable model, onnxruntime's
    fused model and, where the portable model has a residual sum in front of a normalization,
    both again in the other form (``residual-add`` for the presets' ``Sum``, which lets the
    provider fuse ``SkipLayerNormalization``; ``residual-sum`` for an ``Add``). The fused model is
    taken when it is not slower than the portable one by more than the noise margin (it also
    loads faster); a form of the other residual only when it is faster than the portable one by
    more than the margin. Of the forms taken, the one furthest inside its allowance is kept."""
    from graphtrim.modelio import load_model, save_model

    if target not in _PROVIDERS:
        raise GraphtrimError(f"target {target} has no onnxruntime provider")
    provider = _provider(target)
    tmp = tempfile.TemporaryDirectory(prefix="graphtrim-target-")
    folder = Path(tmp.name)
    try:
        portable = folder / "portable.onnx"
        save_model(model, portable)
        fused_path = folder / "fused.onnx"
        _fuse(portable, fused_path, provider, target)
        fused = load_model(fused_path)
        contrib = {
            k: v
            for k, v in u.op_counts(fused).items()
            if "::" in k and not k.startswith(("ai.onnx::",))
        }
        # name -> (file, accepted when p50 <= portable's p50 times this)
        forms: dict[str, tuple[Path, float]] = {
            "portable": (portable, 1.0),
            "fused": (fused_path, 1 + NOISE_MARGIN),
        }
        # the other residual form (Add <-> Sum in front of normalizations), where there is one
        flipped, flip = _flipped_residuals(portable)
        if flipped is not None:
            flipped_path = folder / f"portable-{flip}.onnx"
            save_model(flipped, flipped_path)
            flipped_fused = folder / f"fused-{flip}.onnx"
            _fuse(flipped_path, flipped_fused, provider, target)
            forms[f"portable+{flip}"] = (flipped_path, 1 - NOISE_MARGIN)
            forms[f"fused+{flip}"] = (flipped_fused, 1 - NOISE_MARGIN)
        names = list(forms)
        loads, p50 = _p50s([forms[n][0] for n in names], provider, runs, threads)
        timed = dict(zip(names, p50, strict=True))
        # each form's p50 against its allowance: the fused form wins ties within the margin,
        # the other residual form must beat the portable one by the margin
        score = {n: timed[n] / forms[n][1] for n in names}
        kept = min((n for n in names if score[n] <= timed["portable"]), key=score.__getitem__)
        record: dict[str, Any] = {
            "target": target,
            "provider": provider,
            "contrib_ops": contrib,
            "nodes_portable": u.count_nodes(model),
            "nodes_fused": u.count_nodes(fused),
            "p50_ms": {n: t * 1e3 for n, t in timed.items()},
            "load_ms": {n: t * 1e3 for n, t in zip(names, loads, strict=True)},
            "kept": kept,
        }
        if kept == "portable":
            record["why"] = (
                "onnxruntime's fused model ran at {:.3f} ms p50 against {:.3f} ms for the portable one".format(
                    timed["fused"] * 1e3, timed["portable"] * 1e3
                )
            )
            tmp.cleanup()
            return model, record
        if kept == "fused":
            chosen = fused
        elif kept == f"portable+{flip}":
            assert flipped is not None
            chosen = flipped
        else:
            chosen = load_model(forms[kept][0])
        # the chosen model's weights live in the temporary folder: keep it as long as the model
        weakref.finalize(chosen, tmp.cleanup)
        return chosen, record
    except BaseException:
        tmp.cleanup()
        raise


def apply_target(result: OptimizeResult) -> OptimizeResult:
    """``result`` with onnxruntime's fusions applied when its target is an onnxruntime one and
    timing keeps them (the change log's ``target`` records the measurement either way)."""
    target = result.log.target.get("target")
    if target not in ORT_TARGETS:
        return result
    model, result.log.target = apply_ort_target(result.model, target)
    record_metadata(model, target, result.log.fusions())
    modified = result.modified or result.log.target["kept"] != "portable"
    return OptimizeResult(model=model, log=result.log, modified=modified)


def _kernel_count(path: Path, out: Path) -> int | None:
    """The nodes onnxruntime's CPU provider runs for the model at ``path`` after its own
    optimizations (ORT_ENABLE_ALL); ``None`` where it cannot load the model."""
    import onnx
    import onnxruntime as ort

    so = _writing_options(out, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    so.intra_op_num_threads = 1
    try:
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return len(onnx.load(str(out), load_external_data=False).graph.node)
    except Exception:
        return None


# multiply-adds that take onnxruntime's CPU provider (one thread) about as long as starting one
# kernel: a 64-wide, two-layer encoder block (1.3 M multiply-adds at 2 x 16 tokens, 53 kernels)
# ran 6-9% slower for 4 kernels more, a ConvNeXt-Tiny (4.5 G an image, 326 kernels) 5-17%
# faster for 28 more
KERNEL_MACS = 300_000


def _matrix_macs(model: ir.Model, dim: int = 2) -> int:
    """Multiply-adds of the model's Conv, ConvTranspose, MatMul and Gemm nodes, symbolic dims
    taken at ``dim`` (verification's default size); a node of unknown shapes counts none."""

    def size(value: ir.Value | None) -> list[int] | None:
        dims = u.symbolic_dims(value)
        return None if dims is None else [d if isinstance(d, int) else dim for d in dims]

    total = 0
    for _, node in u.standard_nodes(model):
        op = node.op_type
        if op not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        a, w, out = size(node.inputs[0]), size(node.inputs[1]), size(node.outputs[0])
        if a is None or w is None or out is None or not a or not w:
            continue
        if op == "Conv":
            total += math.prod(out) * math.prod(w[1:])
        elif op == "ConvTranspose":
            total += math.prod(a) * math.prod(w[1:])
        elif op == "MatMul":
            total += math.prod(out) * a[-1]
        else:
            trans_a = node.attributes.get_int("transA", 0)
            total += math.prod(out) * (a[0] if trans_a else a[-1])
    return total


# the most kernels a scale of ones can save: onnxruntime runs a normalization written out
# without it as seven kernels, where it fuses the input's into one
_SCALE_KERNELS = 6

# weights up to this many bytes are loaded into onnxruntime to count its kernels
SCALES_COUNT_LIMIT = 1 << 30


def settle_norm_scales(src: Path, result: OptimizeResult) -> OptimizeResult:
    """Drop the scales of ones that ``algebraic`` keeps on written-out normalizations (see
    :func:`~graphtrim.graph.passes._transformer_norm.runtime_fused_scale`) unless onnxruntime
    needs them: they cost a node each, and buy one fused kernel in place of six.

    onnxruntime's CPU provider (its optimizations on) counts the kernels it runs for the input
    ``src`` and for the result without the scales. Where the result runs no more, the scales
    go. Where it runs more, what they add is weighed against the input's time, in kernels: its
    own kernels plus its matrix products' multiply-adds at :data:`KERNEL_MACS` per kernel (six
    small kernels weigh little beside a convolution's work). The scales stay only where the
    kernels added come to more than :data:`NOISE_MARGIN` of it, and a centered
    normalization's scale then gets a shift of zeros after it (:func:`add_zero_shifts`: one
    fused kernel where the scale alone leaves three); where even six kernels per scale (the
    most one saves) would not, they go without counting. The decision is the same on
    every run, and the change log's notes say which way it went and why. The onnxruntime
    targets keep the scales (their fusions are measured). Weights over
    :data:`SCALES_COUNT_LIMIT` bytes are not loaded into onnxruntime twice: the scales go (a
    large model's normalizations weigh little beside its matrix products)."""
    from graphtrim.graph.metadata import strip_intermediate_shapes
    from graphtrim.graph.passes._transformer_norm import (
        add_zero_shifts,
        drop_scales,
        fused_scales,
    )
    from graphtrim.modelio import initializer_bytes, load_model, save_model

    if result.log.target.get("target") in ORT_TARGETS:
        return result
    scales = len(fused_scales(result.model))
    if not scales:
        return result
    if initializer_bytes(result.model) > SCALES_COUNT_LIMIT:
        drop_scales(result.model)
        return OptimizeResult(model=result.model, log=result.log, modified=True)
    # the input's time in kernels, from its matrix products' work alone (a lower bound)
    work = _matrix_macs(result.model) / KERNEL_MACS
    if _SCALE_KERNELS * scales <= NOISE_MARGIN * work:
        # not worth counting: even at the most they save, the scales are within the margin
        result.log.notes.append(
            f"dropped {scales} normalization scale(s) of ones: at most {_SCALE_KERNELS} "
            f"kernels each, under {_SCALE_KERNELS * scales / work:.1%} of the input's time "
            f"(its multiply-adds, one kernel taken as {KERNEL_MACS:,})"
        )
        drop_scales(result.model)
        return OptimizeResult(model=result.model, log=result.log, modified=True)
    with tempfile.TemporaryDirectory(prefix="graphtrim-scales-") as tmp:
        folder = Path(tmp)
        kept = folder / "kept.onnx"
        save_model(result.model, kept)
        without = load_model(kept)  # a copy, its weights mapped from the file
        drop_scales(without)
        strip_intermediate_shapes(without)  # as the result is written
        save_model(without, folder / "dropped.onnx")
        del without
        before = _kernel_count(src, folder / "input.ort.onnx")
        after = _kernel_count(folder / "dropped.onnx", folder / "dropped.ort.onnx")
    if before is not None and after is not None and after > before:
        # the kernels the result adds, against the input's time in kernels: its own kernels
        # and its matrix products' work
        share = (after - before) / (before + work)
        counts = (
            f"{after} kernels for the result against {before} for the input (about {share:.1%} "
            f"of the input's time, one kernel taken as {KERNEL_MACS:,} multiply-adds)"
        )
        if share > NOISE_MARGIN:
            shifts = add_zero_shifts(result.model)
            whole = (
                f"; with a shift of zeros after {shifts} of them, so that onnxruntime fuses "
                "each LayerNormalization whole"
                if shifts
                else ""
            )
            result.log.notes.append(
                f"kept {scales} normalization scale(s) of ones: without them onnxruntime would "
                f"run {counts}{whole}"
            )
            return OptimizeResult(model=result.model, log=result.log, modified=True)
        result.log.notes.append(
            f"dropped {scales} normalization scale(s) of ones: onnxruntime runs {counts}"
        )
    drop_scales(result.model)
    return OptimizeResult(model=result.model, log=result.log, modified=True)
