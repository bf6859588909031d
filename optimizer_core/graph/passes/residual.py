"""Residual additions in front of a normalization, written as ``Sum`` (and back).

Rule ``residual-sum`` (exact: ``Sum`` of two tensors is their elementwise ``Add``, with the same
multidirectional broadcasting from opset 8 on):

- ``LayerNormalization(Add(x, r), ...)`` -> ``LayerNormalization(Sum(x, r), ...)``, and the same
  in front of ``RMSNormalization``, when every reader of the ``Add`` is such a normalization
  taking it as its data input and the ``Add`` is not a graph output. A normalization written
  out in elementwise ops (``(s - mean(s)) / sqrt(mean((s - mean(s))^2) + eps)``, with its
  ``* gamma + beta``, and the RMS form without the centering: what exporters write below the
  opsets that have the ops) counts when the Add's readers are all nodes of that pattern.

Rule ``residual-add`` is its inverse (``Sum`` of two tensors in front of normalizations alone
-> ``Add``), for runtimes where the fused kernel pays off: it is in no preset, and the
onnxruntime targets time it (:mod:`graphtrim.ort_target`).

Why: onnxruntime's CPU provider fuses ``Add`` + ``LayerNormalization`` into its contrib
``SkipLayerNormalization`` when it loads a model (only where the sum has no other reader). On
onnxruntime 1.32's CPU provider that kernel measured 2-4x slower than the two ops it replaces,
one thread, float32: [1, 128, 384] 293 us against 70 us, [1, 197, 192] 227 against 63,
[8, 128, 768] 4.7 ms against 1.4 ms, [1, 3136, 96] 1.8 ms against 0.4 ms. The fusion matches
``Add`` only, so ``Sum`` keeps the two fast kernels. onnxruntime first fuses a written-out
normalization into its own op, so the same holds below opset 17: an opset-13 BERT block with
trained (not 1 and 0) norm weights ran 1.20x its input's time once its shapes were inferred and
the fusion could fire, and 1.0x with ``Sum``. Other runtimes see a standard op with the same
result. ``residual-sum`` is in the presets as a *finishing* pass: it runs once after the
fixed point, so no other pass loses the ``Add`` it would have rewritten.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_norm import Norm, match_decomposed, square_of
from graphtrim.graph.rules import Rule, RuleContext, RulePass

_NORMALIZATIONS = ("LayerNormalization", "RMSNormalization")
_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}
)


def _feeds_only_normalizations(value: ir.Value) -> bool:
    uses = list(value.uses())
    return bool(uses) and (
        all(
            u.is_standard(user) and user.op_type in _NORMALIZATIONS and index == 0
            for user, index in uses
        )
        or _feeds_only_decomposed(value)
    )


def _feeds_only_decomposed(value: ir.Value) -> bool:
    """Every reader of ``value`` is a node of one written-out normalization of ``value``."""
    # the normalized value: x itself (RMS) or x - mean(x) (layer norm)
    centered = [value] + [user.outputs[0] for user, _ in value.uses() if u.is_op(user, "Sub")]
    for d in centered:
        for user, _ in d.uses():
            square = user.outputs[0]
            found = square_of(square)
            if found is None or found[0] is not d or len(square.uses()) != 1:
                continue
            mean2 = next(iter(square.uses())).node
            if not u.is_op(mean2, "ReduceMean"):
                continue
            norm = match_decomposed(mean2)
            if isinstance(norm, Norm) and norm.x is value:
                inner = {id(n) for n in norm.nodes}
                return all(id(reader) in inner for reader, _ in value.uses())
    return False


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


def _summed(node: ir.Node, ctx: RuleContext) -> bool | str:
    if u.node_opset(node, ctx.model) < 8:
        return "opset < 8: Add and Sum broadcast differently"
    return _residual(node, ctx)


def _to_add(node: ir.Node, match: bool, ctx: RuleContext) -> None:
    node.op_type = "Add"


RULES: tuple[Rule, ...] = (
    Rule(
        "residual-sum",
        "LayerNormalization(Add(x, r)) -> LayerNormalization(Sum(x, r)) (and RMSNormalization, "
        "and either written out in elementwise ops) when every reader of the Add is such a "
        "normalization's data input and the Add is no graph output: Sum of two tensors is their "
        "Add (broadcasting from opset 8)",
        ("Add",),
        _residual,
        _to_sum,
    ),
)

ADD_RULES: tuple[Rule, ...] = (
    Rule(
        "residual-add",
        "LayerNormalization(Sum(x, r)) -> LayerNormalization(Add(x, r)) (and RMSNormalization) "
        "when every reader of the two-input Sum is such a normalization's data input and the "
        "Sum is no graph output: the inverse of residual-sum (opset 8 on)",
        ("Sum",),
        _summed,
        _to_add,
    ),
)


class ResidualSum(RulePass):
    name = "residual-sum"
    summary = (
        "Add feeding LayerNormalization/RMSNormalization written as Sum "
        "(keeps onnxruntime's CPU provider off its slow SkipLayerNormalization); runs once, "
        "after the other passes"
    )
    rules = RULES
    finishing = True


class ResidualAdd(RulePass):
    name = "residual-add"
    summary = (
        "two-input Sum feeding LayerNormalization/RMSNormalization written as Add (the inverse "
        "of residual-sum, for runtimes whose fused Add + normalization kernel is faster)"
    )
    rules = ADD_RULES
    finishing = True
