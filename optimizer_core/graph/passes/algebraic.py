"""Algebraic simplification (``algebraic``).

Exact rules, applied only when broadcasting cannot change the output shape:

- ``x + 0 -> x``, ``0 + x -> x``, ``x - 0 -> x``, ``x * 1 -> x``, ``1 * x -> x``, ``x / 1 -> x``,
  ``x ** 1 -> x``; on booleans ``x and True``, ``x or False``, ``x xor False`` (either order) -> ``x``.
  A ``* 1`` stays where it is the scale of a normalization written out below the opset of its
  op: onnxruntime fuses such a pattern into one kernel only with its scale ``Mul``.
- ``Neg(Neg(x)) -> x``, ``Not(Not(x)) -> x``
- ``Transpose(Transpose(x, p), q) -> Transpose(x, p[q])`` and ``-> x`` when ``p[q]`` is the identity
- ``Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, a')`` (opset 13+), ``a'`` the positions of both
- ``Reshape(R(x), s) -> Reshape(x, s)`` for ``R`` in Reshape/Flatten/Squeeze/Unsqueeze when ``s``
  copies no dim (no 0 entry): a Reshape reads only the element order, which ``R`` keeps.
- ``Squeeze(Split(Transpose(x, p), a)[i], a) -> Transpose(Gather(x, i, p[a]), p')`` for an
  unbind into pieces of size 1: each piece is transposed on its own, one rank lower.
- ``Where(c, a, b)`` of 1-D values under a constant condition -> the entries it picks, as one
  computed piece or a Concat: TorchScript writes ``x.expand(B, -1, -1)`` as
  ``Where(Equal(s, -1), 1, s)`` over ``s = Concat(B, -1, -1)``, whose condition is known.

The rules that round differently (merging constant chains, ``Reciprocal`` pairs) are the
``reassociate`` pass (:mod:`graphtrim.graph.passes.reassociate`).

This module holds the neutral elements, the involutions and the pass's rule table; the other
families' checks and rewrites are in ``_algebra_transpose`` (Transposes), ``_algebra_reshape``
(Reshape, Unsqueeze, Slice), ``_algebra_unbind`` (unbinds of a Transpose) and
``_algebra_select`` (Concat, Where).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._algebra_reshape import (
    after_reshape,
    merge_slices,
    merge_unsqueezes,
    one_reshape,
    reshape_of,
    slice_pair,
    static_copies,
    unsqueeze_pair,
    write_copies,
)
from graphtrim.graph.passes._algebra_select import (
    concat_of_concat,
    flatten_concat,
    where_select,
    write_selection,
)
from graphtrim.graph.passes._algebra_transpose import (
    as_reshape,
    compose_transposes,
    split_before_transpose,
    transpose_cancel,
    transpose_compose,
    transpose_reshape,
    transpose_split_transpose,
    transposes_around_unsqueeze,
    unit_transpose,
    unsqueeze_then_transpose,
)
from graphtrim.graph.passes._algebra_unbind import (
    sliced_unbind_of_transpose,
    unbind_before_transpose,
    unbind_of_transpose,
)
from graphtrim.graph.passes._transformer_norm import runtime_fused_scale
from graphtrim.graph.rules import (
    Rule,
    RuleContext,
    RulePass,
    replace_output,
    reroute_refusal,
)

__all__ = ["RULES", "AlgebraicSimplification"]


def _broadcast_keeps_shape(x: ir.Value, c: ir.Value) -> bool:
    """Broadcasting ``x`` with constant ``c`` yields exactly the shape of ``x``."""
    c_shape = u.const_shape(c)
    if c_shape is None:
        return False
    if len(c_shape) == 0:
        return True
    x_dims = u.symbolic_dims(x)
    if x_dims is None and len(c_shape) == 1:
        # a vector c (a bias, a normalization's weight) keeps the shape of any x whose last dim
        # is c's length (or c has one element) and whose rank is at least 1
        d = u.last_dim(x)
        return d is not None and (c_shape[0] == 1 or d == c_shape[0])
    if x_dims is None or len(c_shape) > len(x_dims):
        return False
    for cd, xd in zip(reversed(c_shape), reversed(x_dims), strict=False):
        if cd != 1 and not (isinstance(xd, int) and xd == cd):
            return False
    return True


def _same_dtype(a: ir.Value, b: ir.Value) -> bool:
    return a.dtype is None or b.dtype is None or a.dtype == b.dtype


def _neutral(operand: int, neutral: float) -> Callable[[ir.Node, RuleContext], Any]:
    """Check: input ``operand`` is the neutral element for the other input, which the output
    then equals."""

    def check(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
        if len(node.inputs) != 2:
            return "not two inputs"
        x, c = node.inputs[1 - operand], node.inputs[operand]
        if x is None or c is None:
            return "an input is missing"
        if not u.is_all(c, neutral):
            return f"input {operand} is not a constant {neutral:g}"
        if not _broadcast_keeps_shape(x, c):
            return "broadcasting may change the shape"
        if not _same_dtype(x, node.outputs[0]):
            return "the output's type differs from the operand's"
        if node.op_type == "Mul" and runtime_fused_scale(x, c, u.node_opset(node, ctx.model)):
            return "the scale of a written-out normalization, which onnxruntime fuses with it"
        return reroute_refusal(node.outputs[0], x) or x

    return check


def _involution(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """``f(f(x)) -> x`` for the node's own op ``f``."""
    x = node.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None or not u.is_op(producer, node.op_type) or producer.inputs[0] is None:
        return f"the input is not produced by {node.op_type}"
    src = producer.inputs[0]
    return reroute_refusal(node.outputs[0], src) or src


def _read_source(node: ir.Node, src: ir.Value, ctx: RuleContext) -> None:
    node.replace_input_with(0, src)


_BROADCAST = "when broadcasting keeps x's shape and the output has x's dtype"

RULES: tuple[Rule, ...] = (
    Rule("x+0", f"x + 0 -> x {_BROADCAST}", ("Add",), _neutral(1, 0), replace_output),
    Rule("0+x", f"0 + x -> x {_BROADCAST}", ("Add",), _neutral(0, 0), replace_output),
    Rule("x-0", f"x - 0 -> x {_BROADCAST}", ("Sub",), _neutral(1, 0), replace_output),
    Rule("x*1", f"x * 1 -> x {_BROADCAST}", ("Mul",), _neutral(1, 1), replace_output),
    Rule("1*x", f"1 * x -> x {_BROADCAST}", ("Mul",), _neutral(0, 1), replace_output),
    Rule("x/1", f"x / 1 -> x {_BROADCAST}", ("Div",), _neutral(1, 1), replace_output),
    Rule("x**1", f"x ** 1 -> x {_BROADCAST}", ("Pow",), _neutral(1, 1), replace_output),
    # the masks of attention exports: `And(True, x)` where a mask term is always true
    Rule("x-and-true", f"And(x, True) -> x {_BROADCAST}", ("And",), _neutral(1, 1), replace_output),
    Rule("true-and-x", f"And(True, x) -> x {_BROADCAST}", ("And",), _neutral(0, 1), replace_output),
    Rule("x-or-false", f"Or(x, False) -> x {_BROADCAST}", ("Or",), _neutral(1, 0), replace_output),
    Rule("false-or-x", f"Or(False, x) -> x {_BROADCAST}", ("Or",), _neutral(0, 0), replace_output),
    Rule(
        "x-xor-false", f"Xor(x, False) -> x {_BROADCAST}", ("Xor",), _neutral(1, 0), replace_output
    ),
    Rule(
        "false-xor-x", f"Xor(False, x) -> x {_BROADCAST}", ("Xor",), _neutral(0, 0), replace_output
    ),
    Rule("neg-neg", "Neg(Neg(x)) -> x", ("Neg",), _involution, replace_output),
    Rule("not-not", "Not(Not(x)) -> x", ("Not",), _involution, replace_output),
    Rule(
        "transpose-transpose-cancel",
        "Transpose(Transpose(x, p), q) -> x when p[q] is the identity",
        ("Transpose",),
        transpose_cancel,
        replace_output,
    ),
    Rule(
        "transpose-transpose-compose",
        "Transpose(Transpose(x, p), q) -> Transpose(x, p[q]) (absent perms reverse the axes)",
        ("Transpose",),
        transpose_compose,
        compose_transposes,
    ),
    Rule(
        "transpose-unsqueeze-transpose",
        "Transpose(Unsqueeze(Transpose(x, p), a), q) -> Unsqueeze(x, a') (Transpose(.., q') "
        "after it unless the permutations cancel): a' are the positions of the output's unit "
        "dims, q' orders x's axes as p and q do; each inner result read once (opset 13+)",
        ("Transpose",),
        transposes_around_unsqueeze,
        unsqueeze_then_transpose,
    ),
    *(
        Rule(
            f"reshape-{op.lower()}",
            f"{op}(Reshape(x, s), a) -> Reshape(x, s') for a constant s that copies no dim: s' "
            + (
                "is s with 1s inserted at the axes"
                if op == "Unsqueeze"
                else "is s without its entries at the axes, each 1"
            )
            + "; the Reshape's result read there alone (opset 13+)",
            (op,),
            after_reshape,
            one_reshape,
        )
        for op in ("Unsqueeze", "Squeeze")
    ),
    Rule(
        "transpose-unit-reshape",
        "Transpose(x, p) -> Reshape(x, s) when p moves only dims of size 1 (the others keep "
        "their order, so the element order is x's); s holds the static sizes, 0 for a symbolic "
        "dim that stays in place and at most one -1 (a Reshape moves no data)",
        ("Transpose",),
        unit_transpose,
        as_reshape,
    ),
    Rule(
        "transpose-split-transpose",
        "Transpose(Reshape(Transpose(x, p1), s), p2) -> Transpose(Reshape(x, s'), p) where the "
        "Reshape only splits axes (static shapes): s' splits x's axes alike, p is p1 and p2 "
        "composed over the split axes; the Transpose goes too when p keeps the order "
        "(flatten, transpose, view into heads, permute: a single view)",
        ("Transpose",),
        transpose_split_transpose,
        split_before_transpose,
    ),
    Rule(
        "transpose-unbind",
        "Squeeze(Split(Transpose(x, p), a)[i], a) -> Transpose(Gather(x, i, p[a]), p') for "
        "pieces proved of size 1, each read by such a Squeeze alone: p' is p without axis a "
        "(no Transpose when that keeps the order). Each piece is transposed on its own at one "
        "rank less, the same data moved, and its Transpose can merge with the ones after it "
        "(q @ k.transpose(-2, -1)) or into a MatMul's transA/transB",
        ("Split",),
        unbind_of_transpose,
        unbind_before_transpose,
    ),
    Rule(
        "transpose-unbind-slices",
        "Squeeze(Slice(Transpose(x, p), [i, i+1), a), a) -> Transpose(Gather(x, i, p[a]), p') "
        "where every reader of the Transpose is such a Slice of one element along the same "
        "axis, each read by such a Squeeze alone (the unbind as torch's dynamo exporter writes "
        "it); p' as for transpose-unbind",
        ("Transpose",),
        sliced_unbind_of_transpose,
        unbind_before_transpose,
    ),
    Rule(
        "slice-slice",
        "Slice(Slice(x, s1, e1, a1, t1), s2, e2, a2, t2) -> Slice(x, s1+s2, e1+e2, a1+a2, "
        "t1+t2) (lists joined) for constant parameters on disjoint axes: slicing one axis does "
        "not move the others; the inner result read by such Slices alone, each merged (opset 10+)",
        ("Slice",),
        slice_pair,
        merge_slices,
    ),
    Rule(
        "unsqueeze-unsqueeze",
        "Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, b + the positions of a among the axes "
        "b leaves), for constant axes (inputs from opset 13, attributes before)",
        ("Unsqueeze",),
        unsqueeze_pair,
        merge_unsqueezes,
    ),
    Rule(
        "reshape-static-copy",
        "Reshape(x, s) -> Reshape(x, s') where s (constant, allowzero 0) copies a dim of x that "
        "is static: s' writes that size (the same shape), so the Reshape no longer depends on "
        "how x was produced",
        ("Reshape",),
        static_copies,
        write_copies,
    ),
    *(
        Rule(
            f"{op.lower()}-reshape",
            f"Reshape({op}(x), s) -> Reshape(x, s) when s is constant and copies no dim (no 0 "
            f"entry, or allowzero=1) but ones x has at the same position (the same static size "
            f"or name): a Reshape reads only the element order, which {op} keeps"
            + (
                "; or s is computed (Shape(y)), the inner Reshape flattens, and each entry "
                "that may be 0 at run time is x's dim at its position"
                if op == "Reshape"
                else ""
            ),
            ("Reshape",),
            reshape_of(op),
            _read_source,
        )
        for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
    ),
    Rule(
        "concat-concat",
        "Concat(a, Concat(b, c, axis), d, axis) -> Concat(a, b, c, d, axis) when every reader "
        "of the inner Concat is a Concat on the same axis (it goes dead)",
        ("Concat",),
        concat_of_concat,
        flatten_concat,
    ),
    Rule(
        "transpose-reshape",
        "Reshape(Transpose(x, p), s) -> Reshape(x, s) when p moves only dims of size 1 (the "
        "element order is x's) and s is constant and copies no dim",
        ("Reshape",),
        transpose_reshape,
        _read_source,
    ),
    Rule(
        "where-constant-select",
        "Where(c, a, b) of 1-D values with a constant condition c -> the picked entries: the "
        "one computed piece they are, or Concat(pieces, constant runs) when a side's Concat "
        "goes dead (each computed piece, a side or a Concat input, picked whole and in order)",
        ("Where",),
        where_select,
        write_selection,
    ),
)


class AlgebraicSimplification(RulePass):
    name = "algebraic"
    summary = (
        "x+0, x-0, x*1, x/1, x**1, double Neg/Not, Transposes (pairs, unbinds), Reshape chains"
    )
    rules = RULES
