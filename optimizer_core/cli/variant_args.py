"""The options of the variant commands that other commands share: the quantization settings,
the weight-only settings (also ``graphtrim pipeline``'s) and the evaluation and calibration data
(also ``graphtrim tune``'s)."""

from __future__ import annotations

import argparse
from typing import Any

from graphtrim.cli.argtypes import csv as _csv
from graphtrim.cli.argtypes import lazy_choices, literal_names, positive_int


def _calibration_methods() -> list[str]:
    return literal_names("graphtrim.quantize.config", "CALIBRATION_METHODS")


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--calibration",
        metavar="C.npz",
        help="calibration data: one array per model input, samples on the first axis",
    )
    # read when used, from the source: the quantizers' module imports numpy and onnx
    lazy_choices(
        p.add_argument("--method", default="minmax", help="calibration method of int8-static"),
        _calibration_methods,
    )
    p.add_argument(
        "--per-tensor",
        action="store_true",
        help="one scale per weight tensor instead of per output channel",
    )
    p.add_argument(
        "--calibration-batches",
        type=positive_int,
        default=None,
        help="int8-static: calibrate on the first N batches only (default: all)",
    )
    p.add_argument(
        "--quant-format",
        choices=("qdq", "qoperator"),
        default="qdq",
        help="int8-static: QuantizeLinear/DequantizeLinear pairs, or onnxruntime's quantized "
        "operators (QLinearConv, QLinearMatMul, ...)",
    )
    p.add_argument("--activation-type", choices=("int8", "uint8"), default="int8")
    p.add_argument("--weight-type", choices=("int8", "uint8"), default="int8")
    p.add_argument(
        "--exclude", type=_csv, default=[], help="comma-separated nodes to keep in float"
    )
    p.add_argument(
        "--max-attempts",
        type=positive_int,
        default=3,
        help="builds allowed for the sensitivity fallback when the accuracy gate fails",
    )
    p.add_argument("--preset", default="default", help="graph optimization preset run first")
    p.add_argument(
        "--no-tune",
        action="store_true",
        help="skip timing runtime-specific rewrites on --device (residual-sum: Add before a "
        "LayerNormalization written as Sum where onnxruntime runs it faster)",
    )
    add_weight_args(p)
    p.add_argument(
        "--fp16-io",
        action="store_true",
        help="fp16: convert the model's inputs and outputs too (default: they stay float32)",
    )


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """The weight-only variants' settings (``graphtrim quantize`` / ``variants`` and the
    pipeline commands); :func:`weight_settings` reads them."""
    w = p.add_argument_group("weight-only variants (int4-weight, int8-weight)")
    w.add_argument(
        "--block-size",
        type=positive_int,
        default=32,
        help="weights per scale along the reduced axis (a power of two, at least 16)",
    )
    w.add_argument(
        "--weight-asymmetric",
        action="store_true",
        help="a zero point per block (default: symmetric, no zero points)",
    )
    w.add_argument(
        "--weight-algorithm",
        choices=("rtn", "hqq"),
        default="rtn",
        help="rtn: round to nearest; hqq: half-quadratic fitted scales and zero points "
        "(4 bits, asymmetric, ort form)",
    )
    w.add_argument(
        "--weight-form",
        choices=("ort", "portable"),
        default="portable",
        help="portable (default): standard DequantizeLinear with block_size + MatMul (opset "
        "21; the model is converted first), which onnxruntime fuses into MatMulNBits; ort: "
        "onnxruntime's MatMulNBits written out",
    )
    w.add_argument(
        "--accuracy-level",
        type=int,
        choices=range(5),
        default=None,
        help="MatMulNBits' accuracy_level (ort form): 4 (default) computes with int8 "
        "activations, 0 in float (slow on CPU)",
    )
    w.add_argument(
        "--quantize-embeddings",
        action="store_true",
        help="int4-weight: the token embedding tables (Gather) too, as onnxruntime's "
        "GatherBlockQuantized (ort form, rtn)",
    )


def weight_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~graphtrim.quantize.QuantizeConfig` fields :func:`add_weight_args` sets."""
    return {
        "block_size": args.block_size,
        "weight_symmetric": not args.weight_asymmetric,
        "weight_algorithm": args.weight_algorithm,
        "weight_form": args.weight_form,
        "accuracy_level": args.accuracy_level,
        "quantize_embeddings": args.quantize_embeddings,
    }


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Evaluation data, gate policy and device: the commands that judge variants."""
    p.add_argument(
        "--data",
        metavar="E.npz",
        help="evaluation data: one array per model input (+ optional labels); "
        "default: seeded random inputs",
    )
    p.add_argument("--label-key", default="labels", help="name of the labels array in the .npz")
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="batch size for dynamic batch dims"
    )
    p.add_argument(
        "--policy",
        metavar="P.yaml",
        help="gate policy (default: the file $GRAPHTRIM_POLICY names, else built-in thresholds)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where to measure: cpu = CPUExecutionProvider, gpu = CUDAExecutionProvider "
        "(an error where there is none)",
    )
    p.add_argument(
        "--tensorrt",
        action="store_true",
        help="with --device gpu: TensorRT's execution provider first, CUDA's as fallback",
    )
    p.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors and results"
    )
