"""Redundant Cast elimination.

``Cast(Cast(x, T1), T2)`` equals ``Cast(x, T2)`` whenever the first cast is exact, i.e. every
value of ``x``'s type is representable in ``T1`` (a widening such as f32 -> f64, f16 -> f32,
int8 -> int32, bool -> anything): the second cast then sees the very value of ``x``. When
``T2`` is ``x``'s own type the pair is a round trip and disappears (``f32 -> f64 -> f32``).
Same-type casts are removed by the identity pass.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace_output, reroute_refusal

D = ir.DataType

_INTS = {
    D.INT8: (True, 8),
    D.INT16: (True, 16),
    D.INT32: (True, 32),
    D.INT64: (True, 64),
    D.UINT8: (False, 8),
    D.UINT16: (False, 16),
    D.UINT32: (False, 32),
    D.UINT64: (False, 64),
}
# significand bits (including the implicit one) and exponent range of the float types
_FLOATS = {D.FLOAT16: (11, 5), D.BFLOAT16: (8, 8), D.FLOAT: (24, 8), D.DOUBLE: (53, 11)}


def is_exact_cast(src: ir.DataType, dst: ir.DataType) -> bool:
    """Every value of ``src`` converts to ``dst`` without change."""
    if src == dst:
        return True
    if src == D.BOOL:
        return dst in _INTS or dst in _FLOATS
    if src in _INTS and dst in _INTS:
        s_signed, s_bits = _INTS[src]
        d_signed, d_bits = _INTS[dst]
        if s_signed == d_signed:
            return d_bits >= s_bits
        return (not s_signed) and d_signed and d_bits > s_bits
    if src in _INTS and dst in _FLOATS:
        s_signed, s_bits = _INTS[src]
        magnitude_bits = s_bits - (1 if s_signed else 0)
        return _FLOATS[dst][0] >= magnitude_bits
    if src in _FLOATS and dst in _FLOATS:
        s_sig, s_exp = _FLOATS[src]
        d_sig, d_exp = _FLOATS[dst]
        return d_sig >= s_sig and d_exp >= s_exp
    return False


def _exact_pair(node: ir.Node) -> tuple[ir.Value, D, D] | str:
    """``Cast(Cast(x, T1), T2)`` whose first cast is exact: ``x``, ``T1`` and ``T2``."""
    mid = node.inputs[0]
    inner = mid.producer() if mid is not None else None
    if inner is None or not u.is_op(inner, "Cast") or inner.inputs[0] is None:
        return "the input is not produced by Cast"
    x = inner.inputs[0]
    t1, t2 = inner.attributes.get_int("to", None), node.attributes.get_int("to", None)
    if x.dtype is None or t1 is None or t2 is None:
        return "a type is unknown"
    if not is_exact_cast(x.dtype, D(t1)):
        return "the first cast is not exact"
    return x, D(t1), D(t2)


def _round_trip(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    pair = _exact_pair(node)
    if isinstance(pair, str):
        return pair
    x, _, t2 = pair
    if t2 != x.dtype:
        return "the second cast is not back to the input's type"
    return reroute_refusal(node.outputs[0], x) or x


def _chain(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    pair = _exact_pair(node)
    if isinstance(pair, str):
        return pair
    x, _, t2 = pair
    if t2 == x.dtype:
        return "a round trip (the other rule)"
    return x


def _cast_input(node: ir.Node, x: ir.Value, ctx: RuleContext) -> None:
    node.replace_input_with(0, x)


RULES: tuple[Rule, ...] = (
    Rule(
        "cast-round-trip",
        "Cast(Cast(x, T1), type(x)) -> x when every value of x's type is representable in T1",
        ("Cast",),
        _round_trip,
        replace_output,
    ),
    Rule(
        "cast-chain",
        "Cast(Cast(x, T1), T2) -> Cast(x, T2) when every value of x's type is representable in "
        "T1 (the second cast sees x's very value)",
        ("Cast",),
        _chain,
        _cast_input,
    ),
)


class CastChainElimination(RulePass):
    name = "casts"
    summary = "collapse Cast chains whose first cast is exact; remove exact round trips"
    rules = RULES
