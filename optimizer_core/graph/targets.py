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
  (the fusions into ``Gelu``, ``RMSNormalization``, ``Attention`` and ``RotaryEmbedding`` stay
  decomposed; TensorRT fuses those patterns itself).

This module holds what the passes may emit; choosing between the portable and the fused model by
measurement is :mod:`graphtrim.ort_target`, above the graph layer. The chosen target, the
fusions applied and the measurement are recorded in the change log and
in the model's metadata (``graphtrim.target``, ``graphtrim.fusions``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import onnx_ir as ir

# fused ops graphtrim could emit that TensorRT's ONNX parser does not take
TENSORRT_AVOID = frozenset({"Gelu", "RMSNormalization", "Attention", "RotaryEmbedding"})


def emits_allowed(target: str, op_type: str) -> bool:
    """Whether a fusion may emit ``op_type`` for ``target``."""
    return not (target == "tensorrt" and op_type in TENSORRT_AVOID)


def record_metadata(model: ir.Model, target: str, fusions: Mapping[str, int]) -> None:
    model.metadata_props["graphtrim.target"] = target
    model.metadata_props["graphtrim.fusions"] = json.dumps(dict(sorted(fusions.items())))
