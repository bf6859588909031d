"""Quantized and reduced-precision variants of a model.

int8 variants wrap ``onnxruntime.quantization`` (dynamic, and static QDQ with calibration); fp16
wraps onnxruntime's float16 converter. graphtrim's own optimizer is the pre-processing (it
handles symbolic shapes, where ``quant_pre_process`` fails) and runs again afterwards to remove
what the conversion leaves behind. When a variant fails its accuracy check, the most sensitive
nodes (measured against the float model on calibration data) go back to float and the variant
is rebuilt, within a budget of attempts.
"""

from __future__ import annotations

from graphtrim.lazy import lazy_attributes
from graphtrim.quantize.kinds import VARIANTS

# imported on first use: the variant table (``kinds``) is read where numpy and onnx are not
_LAZY = {
    "NodeError": "graphtrim.quantize.sensitivity",
    "node_errors": "graphtrim.quantize.sensitivity",
    "CALIBRATION_METHODS": "graphtrim.quantize.config",
    "Attempt": "graphtrim.quantize.records",
    "QuantizeConfig": "graphtrim.quantize.config",
    "VariantBuild": "graphtrim.quantize.records",
    "build_variant": "graphtrim.quantize.build",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "CALIBRATION_METHODS",
    "VARIANTS",
    "Attempt",
    "NodeError",
    "QuantizeConfig",
    "VariantBuild",
    "build_variant",
    "node_errors",
]
