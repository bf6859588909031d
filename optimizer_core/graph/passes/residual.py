"""Residual additions in front of a normalization, written as ``Sum``.

Rule ``residual-sum`` (exact: ``Sum`` of two tensors is their elementwise ``Add``, with the same
multidirectional broadcasting from opset 8 on):

- ``LayerNormalization(Add(x, r), ...)`` -> ``LayerNormalization(Sum(x, r), ...)``, and the same
  in front of ``RMSNormalization``, when every reader of the ``Add`` is such a normalization
  taking it as its data input and the ``Add`` is not a graph output.

Why: onnxruntime's CPU provider fuses ``Add`` + ``LayerNormalization`` into its contrib
``SkipLayerNormalization`` when it loads a model. On onnxruntime 1.32's CPU provider that kernel
measured 5-7x slower than the two ops it replaces ([1, 128, 384] float32: 215 us against 29 us,
one thread; 120 us against 40 us with two), 22% of a dynamically quantized 6-layer BERT's time.
The fusion matches ``Add`` only, so ``Sum`` keeps the two fast kernels. Other runtimes see a
standard op with the same result. The pass is in no preset: the target profiles (``ort-cpu``)
and variant builds tuned for a device apply it only where it measurably helps there (see
``optimizer_core.ort_target.tune_residual_sum``).
"""

from __future__ import annotations

import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.rules import Rule, RuleContext, RulePass

_NORMALIZATIONS = ("LayerNormalization", "RMSNormalization")
_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}
)


def _feeds_only_normalizations(value: ir.Value) -> bool:
    uses = list(value.uses())
    return bool(uses) and all(
        u.is_standard(user) and user.op_type in _NORMALIZATIONS and index == 0
        for user, index in uses
    )


def _residual(node: ir.Node, ctx: RuleContext) -> bool | str:
    if len(node.inputs) != 2 or None in node.inputs:
        return "not two inputs"
    out = node.outputs[0]
    if out.is_graph_output() or out.dtype not in _FLOAT_TYPES:
        return "a graph output or not a float type"
    if not _feeds_only_normalizations(out):
        return "not read by normalizations alone"
    if u.node_opset(node, ctx.model) < 8:
        # Sum broadcasts from opset 8 on; before, its inputs must have equal shapes
        a, b = (u.static_shape(v) for v in node.inputs)
        if a is None or a != b:
            return "shapes may differ and Sum does not broadcast (opset < 8)"
    return True


def _to_sum(node: ir.Node, match: bool, ctx: RuleContext) -> None:
    node.op_type = "Sum"


RULES: tuple[Rule, ...] = (
    Rule(
        "residual-sum",
        "LayerNormalization(Add(x, r)) -> LayerNormalization(Sum(x, r)) (and RMSNormalization) "
        "when every reader of the Add is such a normalization's data input and the Add is no "
        "graph output: Sum of two tensors is their Add (broadcasting from opset 8)",
        ("Add",),
        _residual,
        _to_sum,
    ),
)


class ResidualSum(RulePass):
    name = "residual-sum"
    summary = (
        "Add feeding LayerNormalization/RMSNormalization written as Sum "
        "(keeps onnxruntime's CPU provider off its slow SkipLayerNormalization)"
    )
    rules = RULES
