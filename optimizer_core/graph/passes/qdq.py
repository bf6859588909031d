"""Cleanup of QuantizeLinear / DequantizeLinear (QDQ) pairs.

Notation: ``DQ(q) = (q - zp) * s`` and ``Q(y) = clip(round(y / s) + zp, qmin, qmax)`` with a
scale ``s`` and zero point ``zp``, per tensor (one element) or per axis (a vector along ``axis``).

Rules:

- ``dq-q`` (exact): ``Q(DQ(x, s, zp), s, zp) -> x`` when both nodes use the same constant scale
  and zero point (values, dtypes, ``axis`` and ``block_size``) and the quantized types agree.
  With ``k = x - zp`` an integer, ``|k| <= span = qmax - qmin``, DQ returns ``k * s`` rounded once
  to the scale's float type (relative error at most its unit roundoff ``u``, the product being a
  normal number because ``|s|`` is); Q divides by ``s`` (or multiplies by a rounded ``1 / s``),
  which gives ``k * (1 + d)`` with ``|d| <= 3u`` to first order. The rewrite is made only when
  ``3u * span <= 0.4``, ``|s|`` is at least the smallest normal number and ``|s| * span`` is at
  most half the largest finite one: then the rounding returns ``k`` exactly, ``k + zp = x`` is in
  range (no clipping) and the pair is the identity bit for bit. That holds for every integer
  type with float32 scales, for 8-bit (and 4-bit) types with float16 scales, for 4-bit types only
  with bfloat16 scales. When the DQ output has other readers only the Q's readers are rerouted.
- ``dq-sink`` (exact): ``M(DQ(x, s, zp)) -> DQ(M(x), s, zp)`` for a data-movement op ``M``
  (Reshape, Transpose, Squeeze, Unsqueeze, Flatten) that is the only reader of the DQ output,
  with a per-tensor scale and zero point: DQ then acts on every element alike, so it commutes
  with any op that only moves elements, and the data moves in the quantized type. Pass ``qdq``
  sinks DQs of constants only (quantized weights: constant folding then moves the weight);
  pass ``qdq-move`` sinks any.
- ``q-hoist`` (exact, pass ``qdq-move`` only): ``Q(M(y), s, zp) -> M(Q(y, s, zp))`` for the
  same ops and per-tensor parameters, when ``M``'s output has no other reader. Together with
  ``dq-sink`` a chain ``DQ -> M -> Q`` becomes ``M -> DQ -> Q`` (or ``DQ -> Q -> M``), which
  ``dq-q`` then removes. Per-axis or blocked parameters are never moved: the quantization axis
  would move with the data.
- ``q-dq-lossy`` (only with ``allow_lossy``): ``DQ(Q(x, s, zp), s, zp) -> x``. The pair rounds
  ``x`` to the quantization grid and clips it to the representable range; without it the value
  goes through unrounded, so results change (by at most ``s / 2`` per element within the range).

Float8 types and ops of other domains are left alone. Constant folding never folds a
DequantizeLinear, so quantized weights stay quantized; a data-movement op that ``dq-sink``
moved onto a quantized weight is then folded into a quantized initializer.
"""

from __future__ import annotations

from typing import cast

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._qdq import (
    MOVABLE_TYPES,
    QParams,
    clone,
    copy_shape,
    movement_reader,
    params,
    per_tensor,
    round_trip_exact,
    same_params,
)
from graphtrim.graph.rules import (
    Rule,
    RuleContext,
    RulePass,
    replace,
    replace_output,
    reroute_refusal,
)

_DEAD = "the node is dead (an earlier rewrite rerouted its readers)"


def new_name(ctx: RuleContext, hint: str | None, suffix: str) -> str:
    return cast("QdqCleanup", ctx.pass_).new_name(hint, suffix)


# ---------------------------------------------------------------- DQ -> Q


def _round_trip(outer: ir.Node, inner_op: str) -> tuple[ir.Value, QParams, QParams] | str:
    """``x`` of ``outer(inner(x))``, a Q and DQ pair with the same parameters that gives back
    ``x``'s type, with the Q's and the DQ's parameters."""
    mid = outer.inputs[0]
    inner = mid.producer() if mid is not None else None
    x = inner.inputs[0] if inner is not None and u.is_op(inner, inner_op) else None
    if inner is None or x is None:
        return f"the input is not a {inner_op}"
    q, dq = (inner, outer) if inner_op == "QuantizeLinear" else (outer, inner)
    qp, dqp = params(q), params(dq)
    if qp is None or dqp is None:
        return "attributes or types not understood"
    if inner_op == "QuantizeLinear":
        back, types, inner_params, outer_params = dqp.ftype, "float", qp, dqp
    else:
        back, types, inner_params, outer_params = qp.qtype, "quantized", dqp, qp
    if x.dtype is None or x.dtype != back:
        return f"the {types} types differ"
    if not same_params(inner_params, outer_params, u.rank(x)):
        return "different scales, zero points, axes or blocks"
    return x, qp, dqp


def check_dq_q(q: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """``x`` of ``Q(DQ(x))`` when the pair is the identity bit for bit."""
    if u.is_dead(q):
        return _DEAD
    found = _round_trip(q, "DequantizeLinear")
    if isinstance(found, str):
        return found
    x, _, dqp = found
    if not round_trip_exact(dqp):
        return "the round trip may round or clip"
    return reroute_refusal(q.outputs[0], x) or x


# ---------------------------------------------------------------- Q -> DQ (lossy)


def check_q_dq_lossy(dq: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """``x`` of ``DQ(Q(x))`` with the same parameters, when lossy rewrites are allowed."""
    if u.is_dead(dq):
        return _DEAD
    if not ctx.options.allow_lossy:
        return "allow_lossy is off"
    found = _round_trip(dq, "QuantizeLinear")
    if isinstance(found, str):
        return found
    x = found[0]
    return reroute_refusal(dq.outputs[0], x) or x


# ---------------------------------------------------------------- DQ sinks below data movement


def _check_dq_sink(dq: ir.Node, any_input: bool) -> ir.Node | str:
    if u.is_dead(dq):
        return _DEAD
    x = dq.inputs[0]
    move = movement_reader(dq.outputs[0])
    if x is None or move is None:
        return "not read by a data-movement op alone"
    if x.dtype not in MOVABLE_TYPES:
        return "a quantized type data is not moved in"
    if not any_input and not u.is_constant(x):
        return "not a constant (pass qdq-move sinks any)"
    p = params(dq)
    if p is None or not per_tensor(p):
        return "not per-tensor parameters"
    return move


def check_dq_sink_constant(dq: ir.Node, ctx: RuleContext) -> ir.Node | str:
    """The data-movement op reading ``DQ(w)`` of a constant ``w`` alone."""
    return _check_dq_sink(dq, any_input=False)


def check_dq_sink(dq: ir.Node, ctx: RuleContext) -> ir.Node | str:
    """The data-movement op reading ``DQ(x)`` alone."""
    return _check_dq_sink(dq, any_input=True)


def sink_dq(dq: ir.Node, move: ir.Node, ctx: RuleContext) -> None:
    """``M(DQ(x, s, zp)) -> DQ(M(x), s, zp)``."""
    x = dq.inputs[0]
    assert x is not None
    old = move.outputs[0]
    moved = clone(move, [x, *move.inputs[1:]], new_name(ctx, old.name, "q"), x.dtype)
    moved.outputs[0].shape = copy_shape(old.shape)
    new_dq = clone(
        dq,
        [moved.outputs[0], *dq.inputs[1:]],
        new_name(ctx, old.name, "dq"),
        old.dtype or dq.outputs[0].dtype,
    )
    new_dq.outputs[0].shape = copy_shape(old.shape)
    ctx.graph.insert_before(move, [moved, new_dq])
    replace(old, new_dq.outputs[0], move.op_type)


DQ_Q = Rule(
    "dq-q",
    "Q(DQ(x, s, zp), s, zp) -> x for the same constant s and zp (values, dtypes, axis, "
    "block_size) and quantized type, when 3u * (qmax - qmin) <= 0.4 for the scale type's unit "
    "roundoff u, |s| >= its smallest normal and |s| * (qmax - qmin) <= half its largest finite "
    "(the division returns x - zp exactly, no clipping)",
    ("QuantizeLinear",),
    check_dq_q,
    replace_output,
)
Q_DQ_LOSSY = Rule(
    "q-dq-lossy",
    "DQ(Q(x, s, zp), s, zp) -> x, only with allow_lossy: the pair rounds x to the grid and clips "
    "it to the range (results change by up to s / 2 per element within the range)",
    ("DequantizeLinear",),
    check_q_dq_lossy,
    replace_output,
)

RULES: tuple[Rule, ...] = (
    DQ_Q,
    Q_DQ_LOSSY,
    Rule(
        "dq-sink",
        "M(DQ(w, s, zp)) -> DQ(M(w), s, zp) for a constant w of an 8- or 16-bit integer type, "
        "per-tensor s and zp, M in {Reshape, Transpose, Squeeze, Unsqueeze, Flatten} the only "
        "reader of DQ's output (DQ acts on every element alike; folding then moves the weight)",
        ("DequantizeLinear",),
        check_dq_sink_constant,
        sink_dq,
    ),
)


class QdqCleanup(RulePass):
    name = "qdq"
    summary = (
        "remove DequantizeLinear -> QuantizeLinear round trips; move data-movement ops on "
        "quantized weights into the weights; with allow_lossy, remove Q -> DQ pairs"
    )
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        self._namer: u.NameGenerator | None = None
        self._model = model
        return super().apply(model)

    def new_name(self, hint: str | None, suffix: str) -> str:
        """A fresh name; the generator is made on first use (it sees the names made before)."""
        if self._namer is None:
            self._namer = u.NameGenerator(self._model)
        return self._namer(f"{hint or 'qdq'}_{suffix}")
