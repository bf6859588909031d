"""The variants graphtrim builds, as one table.

A variant is a line here: its name, one line of help, the converter that turns the optimized
float model into it (none for ``graph``: graph optimization only), what it needs, the gate
thresholds it is held to when a policy says nothing, and its rank when an alias is moved.
Everything else is derived from this table: the build (:func:`graphtrim.quantize.build_variant`),
the built-in gate policy and the promotion order (:mod:`graphtrim.gates.policy`), the CLI's
choices and help, the DAGs' parameters and the pipeline's default variants. Adding a variant is
its converter and its line.

This module imports nothing heavy: the DAGs read it when they are parsed.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class VariantKind:
    """One kind of variant.

    Attributes:
        name: its name (``--variant``, registry names, record keys).
        help: one line for ``--help``.
        converter: ``module:function`` converting the optimized float model:
            ``fn(src, dst, config, excluded_nodes, calibration_feeds, progress)``, returning
            None or a record of what it did (kept with the build); None: the optimized model
            is the variant.
        needs_calibration: refused without calibration data.
        float16: converts to fp16: nodes whose values exceed fp16's range stay in fp32, and
            with ``keep_io_types`` off its inputs are fp16 (float32 feeds cannot be used).
        gates: thresholds it is held to when the policy says nothing (the built-in policy).
        promotion: rank when an alias is moved (lower first); None: never promoted.
        default: built when a run names no variants.
        converts: the op types whose nodes the converter changes (None: any node). The
            sensitivity fallback keeps only those in float: keeping a node in float that the
            converter leaves in float anyway changes nothing (a Softmax in a weight-only
            variant: its error is inherited from the MatMuls before it, amplified).
    """

    name: str
    help: str
    converter: str | None = None
    needs_calibration: bool = False
    float16: bool = False
    gates: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    promotion: int | None = None
    default: bool = False
    converts: tuple[str, ...] | None = None
    advice: str = ""

    def convert(self) -> Any:
        """The converter function (imported on first use)."""
        if self.converter is None:
            raise ValueError(f"variant '{self.name}' has no converter")
        module, _, name = self.converter.partition(":")
        return getattr(importlib.import_module(module), name)


# the gates of the variants whose weights take a byte or less: a quarter of float32's size, with
# room for what stays in float
_QUANTIZED_SIZE: Mapping[str, Any] = {"size": {"max_ratio": 0.35}}

KINDS: tuple[VariantKind, ...] = (
    VariantKind(
        "graph",
        "graph optimization only",
        gates={
            "accuracy": {
                "max_rel_error": 1e-4,
                "min_cosine": 0.9999,
                "min_top1_agreement": 1.0,
                "max_metric_drop": 0.0,
            },
            "size": {"max_ratio": 1.01},
            # the same computation: it must not be slower beyond the measurement's resolution
            "latency": {"min_speedup": 0.98},
        },
        promotion=3,
        default=True,
    ),
    VariantKind(
        "int8-dynamic",
        "int8 weights, activations quantized at run time",
        converter="graphtrim.quantize.int8:convert_int8_dynamic",
        gates=_QUANTIZED_SIZE,
        promotion=1,
        default=True,
    ),
    VariantKind(
        "int8-static",
        "QDQ int8, needs --calibration",
        converter="graphtrim.quantize.int8:convert_int8_static",
        needs_calibration=True,
        gates=_QUANTIZED_SIZE,
        promotion=0,
        default=True,
    ),
    VariantKind(
        "int4-weight",
        "4-bit block-wise MatMul weights, float activations (language models)",
        converter="graphtrim.quantize.weight_converters:convert_int4_weight",
        converts=("MatMul", "Gather"),  # MatMul weights; token embeddings when asked
        gates=_QUANTIZED_SIZE,
        advice=(
            "less 4-bit error: blocks of 16 (--block-size), asymmetric weights "
            "(--weight-asymmetric) or --weight-algorithm hqq; or int8-weight"
        ),
        promotion=4,
    ),
    VariantKind(
        "int8-weight",
        "8-bit block-wise MatMul weights, float activations",
        converter="graphtrim.quantize.weight_converters:convert_int8_weight",
        converts=("MatMul", "Gather"),  # MatMul weights; token embeddings when asked
        gates={"size": {"max_ratio": 0.45}},
        advice="less error: smaller blocks (--block-size)",
        promotion=5,
    ),
    VariantKind(
        "int4-fp16",
        "4-bit block-wise MatMul weights, float16 activations (language models on GPUs)",
        converter="graphtrim.quantize.fp16:convert_int4_fp16",
        float16=True,
        gates=_QUANTIZED_SIZE,
        promotion=6,
    ),
    VariantKind(
        "fp16",
        "float16, for GPU targets",
        converter="graphtrim.quantize.fp16:convert_fp16",
        float16=True,
        gates={
            "accuracy": {"min_cosine": 0.999, "max_metric_drop": 0.005},
            "size": {"max_ratio": 0.6},
        },
        promotion=2,
    ),
)

VARIANTS: tuple[str, ...] = tuple(k.name for k in KINDS)
DEFAULT_VARIANTS: tuple[str, ...] = tuple(k.name for k in KINDS if k.default)
# the order in which variants that passed their gates are considered for an alias
PROMOTION_ORDER: tuple[str, ...] = tuple(
    k.name for k in sorted(KINDS, key=lambda k: k.promotion or 0) if k.promotion is not None
)


def kind(name: str) -> VariantKind:
    """The variant called ``name``."""
    for k in KINDS:
        if k.name == name:
            return k
    raise KeyError(f"unknown variant '{name}': use one of {', '.join(VARIANTS)}")


def variants_help() -> str:
    """``graph (graph optimization only), int8-dynamic (...), ...`` for ``--help``."""
    return ", ".join(f"{k.name} ({k.help})" for k in KINDS)
