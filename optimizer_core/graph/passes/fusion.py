"""Affine fusions into Conv, ConvTranspose and BatchNormalization (portable: standard ONNX ops).

With ``k = gamma / sqrt(var + eps)`` per output channel:

- ``BatchNormalization(Conv(x, W, B))`` -> ``Conv(x, W * k, (B - mean) * k + beta)``
- ``Conv(x, W, B) * c`` -> ``Conv(x, W * c, B * c)`` for a per-channel (or scalar) constant ``c``
- ``Conv(x, W, B) + c`` -> ``Conv(x, W, B + c)`` for a per-channel (or scalar) constant ``c``
- the same three for ``ConvTranspose`` (rules ``convtranspose-bn`` / ``-mul`` / ``-add``), whose
  weight is laid out ``[C_in, C_out / group, k...]``: output channel ``o = g * (C_out / group) + j``
  reads ``W[g * C_in / group : (g + 1) * C_in / group, j]``, so that slice is scaled by ``k[o]``
- ``BatchNormalization(x) * c`` -> BN with ``gamma * c``, ``beta * c``;
  ``BatchNormalization(x) + c`` -> BN with ``beta + c`` (per-channel ``c``)
- ``Conv(x * c, W, B)`` -> ``Conv(x, W', B)`` for a scalar or per-input-channel constant ``c``
  (rule ``mul-conv``): output channel ``o`` of group ``g = o // (C_out / group)`` reads input
  channel ``g * (C_in / group) + j`` through ``W[o, j]``, so ``W'[o, j] = W[o, j] *
  c[g * (C_in / group) + j]``; the zero padding stays zero (``0 * c = 0``)
- ``x * c`` (or ``x / c``) for a one-element constant ``c``, where ``x`` comes from a projection
  ``MatMul(A, W)`` (+ a constant bias) through values read once (rules ``projection-mul`` /
  ``-div``): the factor passes unchanged through layout ops, either side of a MatMul of two
  computed values and the unbind of a fused projection (``Gather`` of one piece of a Reshape
  that splits the last dim), so ``W`` and the bias are scaled in the columns that reach ``x``;
  only by a factor of magnitude at most 1, which never grows a weight.
  These are the attention scales of exported transformers: the scores' ``/ sqrt(d)`` (BERT),
  or ``q * s`` and ``k * s`` on the pieces of one q/k/v projection (scaled dot-product
  attention, TorchScript). A key joined with a cache first keeps its scale. A constant of one
  factor per column (a layer scale: CaiT, ConvNeXt, EfficientFormer) folds when it reads the
  projection's output directly or through its bias.

The new constants are computed in float64 and rounded once to the weight's dtype, so results
differ from the unfused model by rounding only (relative error around 1e-7 in float32); the pass
is therefore not in the ``safe`` preset. A fusion happens only when the intermediate value has no
other reader. A weight read by several Convs (or several ConvTransposes of one ``group``) is
rewritten only when all of them apply the same per-channel scale, and they keep sharing the one
rewritten weight (tied weights stay tied, the model never grows by a weight copy); biases and
BatchNormalization vectors within the folding growth budget get a private copy.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._fusion_rewrites import (
    _sum_check,
    check_into_bn,
    check_into_conv,
    check_into_conv_transpose,
    check_scaled_input,
    fold_into_bn,
    fold_into_conv,
    fold_parallel,
    fold_scaled_input,
)
from graphtrim.graph.passes._linear import check_projection_scale, scale_projection
from graphtrim.graph.rules import Rule, RuleContext, RulePass

_K = "k = gamma / sqrt(var + eps)"


def _conv_rules(op: str, weight: str) -> tuple[Rule, ...]:
    prefix = op.lower()
    tail = (
        f"per output channel o of a {op} with a constant float weight ({weight}); the {op}'s "
        "output read by this node alone; a weight shared with other readers only when all "
        "apply the same scale (they keep sharing the rewritten weight)"
    )
    check = check_into_conv if op == "Conv" else check_into_conv_transpose
    return (
        Rule(
            f"{prefix}-bn",
            f"BatchNormalization({op}(x, W, B)) -> {op}(x, W * k, (B - mean) * k + beta), "
            f"{_K}, {tail}",
            ("BatchNormalization",),
            check,
            fold_into_conv,
        ),
        Rule(
            f"{prefix}-mul",
            f"{op}(x, W, B) * c -> {op}(x, W * c, B * c), {tail}",
            ("Mul",),
            check,
            fold_into_conv,
        ),
        Rule(
            f"{prefix}-add",
            f"{op}(x, W, B) + c -> {op}(x, W, B + c), {tail}",
            ("Add",),
            check,
            fold_into_conv,
        ),
    )


_PROJECTION = (
    "x {op} c for a one-element constant c (or one per column, on the projection's output or "
    "its bias directly), where x comes from a projection MatMul(A, W) (+ a "
    "constant bias b) through values read once, by layout ops (Transpose, Reshape, Squeeze, "
    "Unsqueeze, Flatten), the unbind of a fused projection (a Gather of one piece of a Reshape "
    "that splits the last dim, every reader another piece) or either side of a MatMul of two "
    "computed values -> x, with W and b scaled ({op} c) in the columns that reach x, when the "
    "factor is at most 1 in magnitude (it never grows a weight): the attention scale of a "
    "query (and key) projection"
)

RULES: tuple[Rule, ...] = (
    *_conv_rules("Conv", "[C_out, C_in / group, k...]: W[o] scales by k[o]"),
    *_conv_rules(
        "ConvTranspose",
        "[C_in, C_out / group, k...]: o = g * (C_out / group) + j scales "
        "W[g * C_in / group : (g + 1) * C_in / group, j]",
    ),
    Rule(
        "mul-conv",
        "Conv(x * c, W, B) -> Conv(x, W', B), W'[o, j] = W[o, j] * c[g * (C_in / group) + j] "
        "with g = o // (C_out / group), for a scalar or per-input-channel constant c of the "
        "weight's type; the product read by the Conv alone, a weight shared only with Convs "
        "that read through the same scale (they keep sharing the rewritten weight; zero padding "
        "stays zero)",
        ("Conv",),
        check_scaled_input,
        fold_scaled_input,
    ),
    Rule(
        "conv-sum-conv",
        "Conv(x, Wa, Ba) +/- Conv(x, Wb, Bb) -> Conv(x, Wa +/- Wb', Ba +/- Bb), Wb' = Wb "
        "zero-padded to Wa's window at tap (pa - pb) / dilation: the same input, strides, "
        "dilations, group and channels, Wb's window inside Wa's with the end pads agreeing "
        "(equal output sizes); each Conv's output read by the sum alone, Wa by its Conv alone",
        ("Add", "Sub"),
        _sum_check("conv"),
        fold_parallel,
    ),
    Rule(
        "conv-sum-identity",
        "Conv(x, W, B) +/- x -> Conv(x, W +/- I, B): stride 1, the output as large as the input "
        "(p_begin + p_end = dilation * (k - 1)) with as many channels; output channel o gains "
        "+/-1 at W[o, o mod (C / group), p_begin / dilation] (x - Conv negates W and B first)",
        ("Add", "Sub"),
        _sum_check("identity"),
        fold_parallel,
    ),
    Rule(
        "conv-sum-bn",
        "Conv(x, W, B) +/- BatchNormalization(x) -> Conv(x, W +/- diag(k), B +/- (beta - mean "
        f"* k)), {_K}, at the tap of conv-sum-identity (inference mode; a normalization with "
        "other readers stays for them)",
        ("Add", "Sub"),
        _sum_check("bn"),
        fold_parallel,
    ),
    Rule(
        "bn-mul",
        "BatchNormalization(x, gamma, beta, ...) * c -> BatchNormalization(x, gamma * c, "
        "beta * c, ...) for a per-channel constant c (inference mode)",
        ("Mul",),
        check_into_bn,
        fold_into_bn,
    ),
    Rule(
        "projection-mul",
        _PROJECTION.format(op="*"),
        ("Mul",),
        check_projection_scale,
        scale_projection,
    ),
    Rule(
        "projection-div",
        _PROJECTION.format(op="/") + " (c not zero)",
        ("Div",),
        check_projection_scale,
        scale_projection,
    ),
    Rule(
        "bn-add",
        "BatchNormalization(x, gamma, beta, ...) + c -> BatchNormalization(x, gamma, beta + c, "
        "...) for a per-channel constant c (inference mode)",
        ("Add",),
        check_into_bn,
        fold_into_bn,
    ),
)


class AffineFusion(RulePass):
    name = "fuse-affine"
    exact = False
    summary = (
        "fold BatchNormalization and per-channel Mul/Add into Conv and ConvTranspose; "
        "Mul/Add into BatchNormalization; a per-input-channel Mul in front of a Conv into its "
        "weight; a sum or difference of Convs of one input, with the input or its "
        "BatchNormalization, into one Conv; a scalar scale of a projection's output (an "
        "attention scale) into its weight"
    )
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        # rewritten weights by (original weight, reader op, ConvTranspose group, per-channel
        # scale): tied weights stay tied
        self.fused_weights: dict[tuple[int, str, int, bytes], ir.Value] = {}
        self._namers: dict[int, u.NameGenerator] = {}
        return super().apply(model)

    def namer(self, ctx: RuleContext) -> u.NameGenerator:
        """The name generator of ``ctx.graph`` in this run, made on first use."""
        key = id(ctx.graph)
        if key not in self._namers:
            self._namers[key] = u.NameGenerator(ctx.model)
        return self._namers[key]
