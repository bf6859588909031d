"""Quantized and reduced-precision variants of a model.

int8 variants wrap ``onnxruntime.quantization`` (dynamic, and static QDQ with calibration); fp16
wraps onnxruntime's float16 converter. graphtrim's own optimizer is the pre-processing (it
handles symbolic shapes, where ``quant_pre_process`` fails) and runs again afterwards to remove
what the conversion leaves behind. When a variant fails its accuracy check, the most sensitive
nodes (measured against the float model on calibration data) go back to float and the variant
is rebuilt, within a budget of attempts.
"""

from optimizer_core.quantize.build import (
    CALIBRATION_METHODS,
    VARIANTS,
    Attempt,
    QuantizeConfig,
    VariantBuild,
    build_variant,
)
from optimizer_core.quantize.sensitivity import NodeError, node_errors

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
