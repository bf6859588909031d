"""The settings of a weight-only variant (bits, block size, symmetry, algorithm, form, accuracy
level), checked on construction, and the error a variant that cannot be built raises."""

from __future__ import annotations

import dataclasses

import onnx

from graphtrim.errors import GraphtrimError

WEIGHT_ALGORITHMS: tuple[str, ...] = ("rtn", "hqq")


WEIGHT_FORMS: tuple[str, ...] = ("ort", "portable")


# MatMulNBits' accuracy_level when none is asked for: int8 compute. onnxruntime's CPU kernels
# for level 0 (float compute) are slower than float MatMul on 8 bits (21x measured on a decode
# step) and no faster on 4 bits at sequence length 64; onnxruntime fuses the portable form into
# MatMulNBits at this level too (its session.qdq_matmulnbits_accuracy_level defaults to 4)
DEFAULT_ACCURACY_LEVEL = 4


# the opset whose DequantizeLinear has block_size and int4 inputs
PORTABLE_OPSET = 21


class WeightOnlyError(GraphtrimError):
    """A weight-only variant cannot be built with the settings asked for."""


@dataclasses.dataclass(frozen=True)
class WeightOnlySettings:
    bits: int
    block_size: int
    symmetric: bool
    algorithm: str
    form: str
    accuracy_level: int | None = None
    # Gather tables (token embeddings) too: onnxruntime's GatherBlockQuantized (ort form, 4 bits)
    embeddings: bool = False

    def validate(self) -> None:
        if self.bits not in (4, 8):
            raise WeightOnlyError(f"weight-only quantization has 4 or 8 bits, not {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise WeightOnlyError(
                f"block size must be a power of two of at least 16, not {self.block_size}"
            )
        if self.algorithm not in WEIGHT_ALGORITHMS:
            raise WeightOnlyError(
                f"unknown weight algorithm '{self.algorithm}': use one of "
                f"{', '.join(WEIGHT_ALGORITHMS)}"
            )
        if self.form not in WEIGHT_FORMS:
            raise WeightOnlyError(
                f"unknown weight form '{self.form}': use one of {', '.join(WEIGHT_FORMS)}"
            )
        if self.algorithm == "hqq":
            if self.bits != 4:
                raise WeightOnlyError("HQQ quantizes to 4 bits only")
            if self.form == "portable":
                raise WeightOnlyError(
                    "HQQ's zero points are floats, which DequantizeLinear cannot take: "
                    "use the ort form, or the rtn algorithm for the portable one"
                )
            if self.symmetric:
                raise WeightOnlyError("HQQ is asymmetric: its zero points are fitted")
        if self.embeddings and (self.form != "ort" or self.bits != 4 or self.algorithm != "rtn"):
            raise WeightOnlyError(
                "embedding tables are quantized in the ort form, with 4 bits and rtn only "
                "(onnxruntime's GatherBlockQuantized; onnx's Gather takes no 4-bit table, so "
                "the portable form has no standard op for it)"
            )
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise WeightOnlyError("accuracy level is 0 to 4 (MatMulNBits' accuracy_level)")
        if self.accuracy_level is not None and self.form == "portable":
            raise WeightOnlyError(
                "accuracy level is an attribute of the ort form only (onnxruntime picks it "
                "for the portable form: session option session.qdq_matmulnbits_accuracy_level)"
            )


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
