"""The int8 converters: onnxruntime's ``quantize_dynamic`` and ``quantize_static`` (QDQ or
QOperator form, calibrated)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import onnx

from graphtrim.data import CalibrationReader
from graphtrim.quantize.config import QuantizeConfig
from graphtrim.quantize.convert import Conversion, model_bytes


def _quant_type(name: str) -> Any:
    from onnxruntime.quantization import QuantType

    return QuantType.QInt8 if name == "int8" else QuantType.QUInt8


def standard_attention_nodes(path: Path) -> list[str]:
    """Names of the standard-domain ``Attention`` nodes (opset 23) of the model at ``path``.

    onnxruntime's dynamic quantizer keys its operator table on the op type alone: it rewrites
    any ``Attention`` as its contrib ``QAttention``, whose inputs are (activation, packed QKV
    weight). A standard ``Attention`` reads Q, K and V activations, so the rewrite yields a model
    onnxruntime refuses to load. These nodes have no weights to quantize: they stay in float.
    """
    model = onnx.load(str(path), load_external_data=False)
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and n.name
    ]


def convert_int8_dynamic(job: Conversion) -> None:
    """int8 weights with onnxruntime's ``quantize_dynamic`` (attention kept in float), its shape
    inference lent one that copies no weights (:mod:`graphtrim.quantize.shapes`)."""
    from onnxruntime.quantization import quantize_dynamic

    from graphtrim.quantize.shapes import weightless_shape_inference

    cfg = job.config
    keep_float = sorted(set(job.excluded) | set(standard_attention_nodes(job.source)))
    with weightless_shape_inference():
        quantize_dynamic(
            job.source,
            job.target,
            op_types_to_quantize=cfg.op_types,
            per_channel=cfg.per_channel,
            reduce_range=True if cfg.reduce_range is None else cfg.reduce_range,
            weight_type=_quant_type(cfg.weight_type),
            nodes_to_exclude=keep_float,
            use_external_data_format=model_bytes(job.source) > 1_500_000_000,
        )


# the first opset whose DequantizeLinear takes an ``axis``: per-channel QDQ needs it
PER_CHANNEL_QDQ_OPSET = 13


def _per_channel_source(
    src: Path, tmp: Path, cfg: QuantizeConfig
) -> tuple[Path, bool, dict[str, Any] | None]:
    """The model to quantize, whether per channel, and a note when either changed.

    onnxruntime's QDQ quantizer writes per-channel ``DequantizeLinear(axis=...)`` whatever the
    model's opset; below 13 that attribute does not exist and the result is invalid. Such a
    model is raised to opset 13 first (onnx's version converter, exact); one the converter
    cannot raise, or one too large to convert in memory (external data), is quantized per
    tensor instead, and the note says which and why.
    """
    if not cfg.per_channel or cfg.quant_format != "qdq":
        return src, cfg.per_channel, None
    proto = onnx.load(str(src), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset >= PER_CHANNEL_QDQ_OPSET:
        return src, True, None
    why = f"opset {opset} has no per-channel DequantizeLinear (it needs {PER_CHANNEL_QDQ_OPSET})"
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return src, False, {"per_channel": f"per tensor: {why}; external data is not converted"}
    from onnx import version_converter

    try:
        # no initializer is external, so the proto read above already holds every weight
        converted = version_converter.convert_version(proto, PER_CHANNEL_QDQ_OPSET)
        onnx.checker.check_model(converted)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            src,
            False,
            {"per_channel": f"per tensor: {why}, and it cannot be raised: {reason}"},
        )
    out = tmp / "opset13.onnx"
    onnx.save(converted, str(out))
    return out, True, {"opset": f"raised from {opset} to {PER_CHANNEL_QDQ_OPSET}: {why}"}


def convert_int8_static(job: Conversion) -> dict[str, Any] | None:
    """QDQ int8 with onnxruntime's ``quantize_static``, calibrated on ``job.calibration``; a
    model below opset 13 is raised to it for per-channel weights (see
    :func:`_per_channel_source`)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    cfg = job.config
    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[cfg.method]
    with tempfile.TemporaryDirectory(prefix="graphtrim-calib-") as tmp:
        source, per_channel, note = _per_channel_source(job.source, Path(tmp), cfg)
        if note is not None:
            job.say(f"int8-static: {next(iter(note.values()))}")
        batches = list(job.calibration)[: cfg.calibration_batches]
        quantize_static(
            source,
            job.target,
            CalibrationReader(batches, progress=job.progress),
            quant_format=QuantFormat.QDQ if cfg.quant_format == "qdq" else QuantFormat.QOperator,
            op_types_to_quantize=cfg.op_types,
            per_channel=per_channel,
            reduce_range=bool(cfg.reduce_range),
            activation_type=_quant_type(cfg.activation_type),
            weight_type=_quant_type(cfg.weight_type),
            nodes_to_exclude=list(job.excluded),
            use_external_data_format=model_bytes(job.source) > 1_500_000_000,
            calibrate_method=method,
            extra_options={"CalibTensorRangeSymmetric": False},
            calibration_cache_path=None,
        )
    return note
