"""Reassociation of constants (``reassociate``, not in the ``safe`` preset).

Rules that round differently (relative error of the order of one ulp):

- ``(x * c1) * c2 -> x * (c1 * c2)`` and ``(x + c1) + c2 -> x + (c1 + c2)`` for constants whose
  product/sum is no larger than the larger of them (broadcasting never grows a constant)
- ``Reciprocal(Reciprocal(x)) -> x``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import (
    Rule,
    RuleContext,
    RulePass,
    replace_output,
    reroute_refusal,
)


def _reciprocal_pair(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    x = node.inputs[0]
    inner = x.producer() if x is not None else None
    if not u.is_op(inner, "Reciprocal") or inner is None or inner.inputs[0] is None:
        return "the input is not produced by Reciprocal"
    src = inner.inputs[0]
    return reroute_refusal(node.outputs[0], src) or src


def _chain(op: str) -> Callable[[ir.Node, RuleContext], Any]:
    """Check: ``op(op(y, c1), c2)`` with constants whose merge is no larger than either; the
    match is ``y``, the merged constant and the name of ``c2``."""

    def check(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, np.ndarray, str] | str:
        _namer(ctx)
        if len(node.inputs) != 2:
            return "not two inputs"
        a, b = node.inputs
        if a is None or b is None:
            return "an input is missing"
        x, c2 = (a, b) if u.is_constant(b) else (b, a)
        if not u.is_constant(c2) or u.is_constant(x) or not u.single_consumer(x):
            return "not one constant and one single-use computed input"
        inner = x.producer()
        if inner is None or not u.is_op(inner, node.op_type) or len(inner.inputs) != 2:
            return f"the computed input is not produced by a binary {op}"
        ia, ib = inner.inputs
        if ia is None or ib is None:
            return "an inner input is missing"
        y, c1 = (ia, ib) if u.is_constant(ib) else (ib, ia)
        if not u.is_constant(c1) or u.is_constant(y):
            return "the inner node has not one constant and one computed input"
        v1, v2 = u.const_array(c1), u.const_array(c2)
        if v1 is None or v2 is None or v1.dtype != v2.dtype or v1.dtype.kind not in "fiu":
            return "constants of different or non-numeric types"
        merged_shape = np.broadcast_shapes(v1.shape, v2.shape)
        if int(np.prod(merged_shape)) > max(v1.size, v2.size):
            return "the merged constant would be larger"
        with np.errstate(all="ignore"):
            merged = (v1 * v2) if node.op_type == "Mul" else (v1 + v2)
        merged = merged.astype(v1.dtype)
        if merged.dtype.kind == "f" and not np.all(np.isfinite(merged)):
            return "the merged constant overflows"
        return y, merged, c2.name or "c"

    return check


def _namer(ctx: RuleContext) -> u.NameGenerator:
    """One name generator per graph and run, made when the walk reaches the graph's first Mul
    or Add (it knows the names in use then and every name it gave)."""
    assert isinstance(ctx.pass_, ReassociateConstants)
    namers = ctx.pass_.namers
    namer = namers.get(id(ctx.graph))
    if namer is None:
        namer = namers[id(ctx.graph)] = u.NameGenerator(ctx.model)
    return namer


def _merge_chain(node: ir.Node, match: tuple[ir.Value, np.ndarray, str], ctx: RuleContext) -> None:
    y, merged, hint = match
    const = u.add_initializer(ctx.graph, merged, _namer(ctx)(f"{hint}_merged"))
    node.replace_input_with(0, y)
    node.replace_input_with(1, const)


_CHAIN = (
    "for constants c1, c2 of one numeric type whose broadcast is no larger than the larger of "
    "them, the computed input used only there, and a finite result (rounds differently)"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "mul-chain",
        f"(x * c1) * c2 -> x * (c1 * c2) {_CHAIN}",
        ("Mul",),
        _chain("Mul"),
        _merge_chain,
    ),
    Rule(
        "add-chain",
        f"(x + c1) + c2 -> x + (c1 + c2) {_CHAIN}",
        ("Add",),
        _chain("Add"),
        _merge_chain,
    ),
    Rule(
        "reciprocal-reciprocal",
        "Reciprocal(Reciprocal(x)) -> x (rounds differently: 1/(1/x) need not be x)",
        ("Reciprocal",),
        _reciprocal_pair,
        replace_output,
    ),
)


class ReassociateConstants(RulePass):
    name = "reassociate"
    exact = False
    summary = "merge chains of constant Mul/Add; Reciprocal pairs (rounding may differ by an ulp)"
    rules = RULES

    def __init__(self, options: Any = None):
        super().__init__(options)
        # graph id -> its name generator for the current run (see ``_namer``)
        self.namers: dict[int, u.NameGenerator] = {}

    def apply(self, model: ir.Model) -> bool:
        self.namers = {}
        return super().apply(model)
