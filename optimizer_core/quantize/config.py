"""How variants are built: :class:`QuantizeConfig` and the choices its fields take."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from graphtrim.quantize.errors import QuantizeError

CALIBRATION_METHODS: tuple[str, ...] = ("minmax", "entropy", "percentile")
QUANT_TYPES: tuple[str, ...] = ("int8", "uint8")
# int8-static's form: QuantizeLinear/DequantizeLinear pairs around float ops, or onnxruntime's
# quantized operators (QLinearConv, QLinearMatMul, ...)
QUANT_FORMATS: tuple[str, ...] = ("qdq", "qoperator")

# ops whose fp16 results overflow or lose too much in typical models: computed in float32
FP16_KEEP_FLOAT = ("Pow", "ReduceSumSquare", "ReduceL2", "Exp", "Log", "Softplus", "CumSum")
FP16_MAX = 65504.0


@dataclasses.dataclass
class QuantizeConfig:
    """How variants are built. Part of the config hash that identifies a result."""

    preset: str = "default"
    per_channel: bool = True
    method: str = "minmax"
    activation_type: str = "int8"
    weight_type: str = "int8"
    # 7-bit weights. None: each kind's default, on for int8-dynamic: its uint8 activations
    # times int8 weights saturate in onnxruntime's x86 kernels on CPUs without VNNI (AVX2 and
    # AVX-512 before VNNI; measured: cosine 0.989 against 0.9998 on an attention block), off for
    # int8-static (int8 activations)
    reduce_range: bool | None = None
    op_types: list[str] | None = None
    # int8-static: the form written (QUANT_FORMATS) and how many calibration batches are read
    # (None: all of them)
    quant_format: str = "qdq"
    calibration_batches: int | None = None
    nodes_to_exclude: list[str] = dataclasses.field(default_factory=list)
    max_attempts: int = 3
    fallback_fraction: float = 0.1
    keep_io_types: bool = True
    fp16_keep_float: list[str] = dataclasses.field(default_factory=lambda: list(FP16_KEEP_FLOAT))
    # the device the variant is built for (``cpu`` / ``gpu``): rewrites that only pay off on
    # some runtimes (``residual-sum``) are timed there and kept where faster; None: not tuned
    tune_device: str | None = None
    # int4-weight / int8-weight (block-wise, MatMul weights): see graphtrim.quantize.weight_only
    block_size: int = 32
    weight_symmetric: bool = True
    weight_algorithm: str = "rtn"
    # "ort": onnxruntime's MatMulNBits; "portable": DequantizeLinear(block_size) + MatMul
    weight_form: str = "portable"
    # MatMulNBits' accuracy_level (ort form); None: 4 (int8 compute), as onnxruntime runs the
    # portable form
    accuracy_level: int | None = None
    # int4-weight: token embedding tables (Gather) too, as GatherBlockQuantized (ort form)
    quantize_embeddings: bool = False

    def weight_settings(self, bits: int) -> Any:
        from graphtrim.quantize.weight_settings import WeightOnlySettings

        return WeightOnlySettings(
            bits=bits,
            block_size=self.block_size,
            symmetric=self.weight_symmetric,
            algorithm=self.weight_algorithm,
            form=self.weight_form,
            accuracy_level=self.accuracy_level,
            embeddings=self.quantize_embeddings and bits == 4,
        )

    def validate(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise QuantizeError(
                f"unknown calibration method '{self.method}': use one of {', '.join(CALIBRATION_METHODS)}"
            )
        for field in ("activation_type", "weight_type"):
            if getattr(self, field) not in QUANT_TYPES:
                raise QuantizeError(f"{field} must be one of {', '.join(QUANT_TYPES)}")
        if self.quant_format not in QUANT_FORMATS:
            raise QuantizeError(f"quant_format must be one of {', '.join(QUANT_FORMATS)}")
        if self.calibration_batches is not None and self.calibration_batches < 1:
            raise QuantizeError("calibration_batches must be at least 1 (or None: all)")
        if self.tune_device not in (None, "cpu", "gpu"):
            raise QuantizeError("tune_device must be 'cpu', 'gpu' or None")
        if self.max_attempts < 1:
            raise QuantizeError("max_attempts must be at least 1")
        if not 0 < self.fallback_fraction <= 1:
            raise QuantizeError("fallback_fraction must be in (0, 1]")
        from graphtrim.quantize.weight_settings import WeightOnlyError

        try:
            self.weight_settings(4).validate()
        except WeightOnlyError as exc:
            raise QuantizeError(str(exc)) from exc

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]
