"""Target profiles: what the optimized model may contain, by the runtime it is meant for.

- ``portable`` (default): standard ONNX ops only; every fusion of the presets emits standard ops.
- ``ort-cpu`` / ``ort-cuda``: after the portable passes, onnxruntime's own offline fusions for
  that execution provider (extended level: FusedConv, SkipLayerNormalization, BiasGelu,
  FusedMatMul, attention fusions ...) are applied, producing a model only onnxruntime runs. The
  fused model is kept only where it measurably helps: interleaved timing of both models on that
  provider, as deployed (onnxruntime's optimizations on), must not be slower than the portable
  model by more than the noise margin; otherwise the portable model is kept and the record says
  why. The fused model loads faster either way (nothing is left for onnxruntime to fuse).
- ``tensorrt``: standard ops, minus the fused ops TensorRT's ONNX parser does not take
  (the fusions into ``Gelu``, ``RMSNormalization`` and ``Attention`` stay decomposed; TensorRT
  fuses those patterns itself).

The chosen target, the fusions applied and the measurement are recorded in the change log and
in the model's metadata (``graphtrim.target``, ``graphtrim.fusions``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx_ir as ir

from optimizer_core.errors import GraphtrimError
from optimizer_core.graph import _ir_utils as u

# fused ops graphtrim could emit that TensorRT's ONNX parser does not take
TENSORRT_AVOID = frozenset({"Gelu", "RMSNormalization", "Attention"})

# a fused model within this fraction of the portable model's p50 counts as not slower
NOISE_MARGIN = 0.02

_PROVIDERS = {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}


def emits_allowed(target: str, op_type: str) -> bool:
    """Whether a fusion may emit ``op_type`` for ``target``."""
    return not (target == "tensorrt" and op_type in TENSORRT_AVOID)


def record_metadata(model: ir.Model, target: str, fusions: Mapping[str, int]) -> None:
    model.metadata_props["graphtrim.target"] = target
    model.metadata_props["graphtrim.fusions"] = json.dumps(dict(sorted(fusions.items())))


def _provider(target: str) -> str:
    import onnxruntime as ort

    from optimizer_core.runtime import GPU_ON_CPU_ENV, providers_for

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
    paths: list[Path], provider: str, runs: int, threads: int
) -> tuple[list[float], list[float]]:
    """Load time and interleaved p50 latency (seconds) of each model, as deployed."""
    import onnxruntime as ort

    from optimizer_core.runtime import session_options
    from optimizer_core.verify.compare import make_inputs

    sessions, loads = [], []
    for path in paths:
        start = time.perf_counter()
        sessions.append(
            ort.InferenceSession(str(path), session_options(threads), providers=[provider])
        )
        loads.append(time.perf_counter() - start)
    specs = [(i.name, i.type, list(i.shape)) for i in sessions[0].get_inputs()]
    feeds = make_inputs(specs, seed=0)
    times: list[list[float]] = [[] for _ in sessions]
    for s in sessions:  # warm-up
        s.run(None, feeds)
    for _ in range(runs):
        for k, s in enumerate(sessions):
            start = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - start)
    return loads, [statistics.median(t) for t in times]


def apply_ort_target(
    model: ir.Model, target: str, *, runs: int = 30, threads: int = 1
) -> tuple[ir.Model, dict[str, Any]]:
    """``model`` with onnxruntime's offline fusions for ``target`` when they do not slow it down,
    and the record of what was done."""
    import onnxruntime as ort

    from optimizer_core.modelio import load_model, save_model

    if target not in _PROVIDERS:
        raise GraphtrimError(f"target {target} has no onnxruntime provider")
    provider = _provider(target)
    tmp = tempfile.TemporaryDirectory(prefix="graphtrim-target-")
    folder = Path(tmp.name)
    try:
        portable = folder / "portable.onnx"
        save_model(model, portable)
        fused_path = folder / "fused.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(fused_path)
        so.log_severity_level = 3
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "fused.onnx.data"
        )
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
        )
        try:
            ort.InferenceSession(str(portable), so, providers=[provider])
        except Exception as exc:
            raise GraphtrimError(
                f"onnxruntime could not fuse the model for {target}: {str(exc).splitlines()[0]}"
            ) from exc
        fused = load_model(fused_path)
        contrib = {
            k: v
            for k, v in u.op_counts(fused).items()
            if "::" in k and not k.startswith(("ai.onnx::",))
        }
        before, after = u.count_nodes(model), u.count_nodes(fused)
        loads, p50 = _p50s([portable, fused_path], provider, runs, threads)
        keep = p50[1] <= p50[0] * (1 + NOISE_MARGIN)
        record: dict[str, Any] = {
            "target": target,
            "provider": provider,
            "contrib_ops": contrib,
            "nodes_portable": before,
            "nodes_fused": after,
            "p50_ms": {"portable": p50[0] * 1e3, "fused": p50[1] * 1e3},
            "load_ms": {"portable": loads[0] * 1e3, "fused": loads[1] * 1e3},
            "kept": "fused" if keep else "portable",
        }
        if not keep:
            record["why"] = (
                f"onnxruntime's fused model ran at {p50[1] * 1e3:.3f} ms p50 against "
                f"{p50[0] * 1e3:.3f} ms for the portable one"
            )
            tmp.cleanup()
            return model, record
        # the fused model's weights live in the temporary folder: keep it as long as the model
        weakref.finalize(fused, tmp.cleanup)
        return fused, record
    except BaseException:
        tmp.cleanup()
        raise
