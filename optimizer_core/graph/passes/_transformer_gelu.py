"""The Gelu fusions of pass ``fuse-transformer`` (opset 20): ``x * 0.5 * (1 + Erf(x / sqrt(2)))``
and ``x * 0.5 * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``, matched from the Erf or
Tanh."""

from __future__ import annotations

import math

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_common import (
    FLOATS,
    close,
    elem_type,
    fusion,
    only_reader,
    other,
    private,
    producer,
    scalar,
    sole_reader,
    split_const,
)
from graphtrim.graph.rules import RuleContext, replace
from graphtrim.graph.targets import emits_allowed


def _erf_arg(value: ir.Value | None) -> ir.Value | None:
    node = producer(value, "Div", "Mul")
    split = split_const(node) if node is not None else None
    if node is None or split is None:
        return None
    c = scalar(split[1])
    want = math.sqrt(2.0) if node.op_type == "Div" else 1.0 / math.sqrt(2.0)
    return split[0] if close(c, want) else None


def _is_cube(value: ir.Value | None, x: ir.Value | None) -> bool:
    """``value`` is ``x ** 3`` or ``x * x * x`` (any association)."""
    p = producer(value, "Pow", "Mul")
    if p is None or x is None or len(p.inputs) != 2:
        return False
    if p.op_type == "Pow":
        return p.inputs[0] is x and scalar(p.inputs[1]) == 3.0
    a, b = p.inputs
    for sq, lone in ((a, b), (b, a)):
        inner = producer(sq, "Mul")
        if lone is x and inner is not None and inner.inputs[0] is x and inner.inputs[1] is x:
            return True
    return False


def _tanh_arg(value: ir.Value | None) -> ir.Value | None:
    # sqrt(2/pi) * (x + 0.044715 * x**3)
    outer = producer(value, "Mul")
    split = split_const(outer) if outer is not None else None
    if split is None or not close(scalar(split[1]), math.sqrt(2.0 / math.pi)):
        return None
    s = producer(split[0], "Add")
    if s is None or len(s.inputs) != 2:
        return None
    for x, cube_term in ((s.inputs[0], s.inputs[1]), (s.inputs[1], s.inputs[0])):
        m = producer(cube_term, "Mul")
        msplit = split_const(m) if m is not None else None
        if msplit is None or not close(scalar(msplit[1]), 0.044715):
            continue
        if _is_cube(msplit[0], x):
            return x
    return None


def _arg_nodes(value: ir.Value | None, x: ir.Value) -> list[ir.Node]:
    """Nodes between ``x`` and the activation's argument (exclusive of ``x``'s producer)."""
    out: list[ir.Node] = []
    pending = [value]
    while pending:
        v = pending.pop()
        if v is None or v is x or u.is_constant(v):
            continue
        node = v.producer()
        if node is None or node in out:
            continue
        out.append(node)
        pending.extend(node.inputs)
    return out


def _half_product(x: ir.Value, a: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """The value ``x * a * 0.5`` (in any association) and its Mul nodes."""
    m = sole_reader(a, "Mul")
    if m is None:
        return None
    o = other(m, a)
    if o is None:
        return None
    if o is x:  # (x * a) * 0.5
        m2 = sole_reader(m.outputs[0], "Mul")
        if m2 is not None and close(scalar(other(m2, m.outputs[0])), 0.5, 0.0):
            return m2.outputs[0], [m, m2]
        return None
    if close(scalar(o), 0.5, 0.0):  # x * (a * 0.5)
        m2 = sole_reader(m.outputs[0], "Mul")
        if m2 is not None and other(m2, m.outputs[0]) is x:
            return m2.outputs[0], [m, m2]
        return None
    half = producer(o, "Mul")  # (x * 0.5) * a
    if half is not None and only_reader(o, m):
        split = split_const(half)
        if split is not None and split[0] is x and close(scalar(split[1]), 0.5, 0.0):
            return m.outputs[0], [m, half]
    return None


def check_gelu(act: ir.Node, ctx: RuleContext) -> tuple[ir.Value, ir.Value] | str:
    """``(x, out)``: the Gelu's input and the value it computes."""
    if fusion(ctx).opset < 20 or not emits_allowed(ctx.options.target, "Gelu"):
        return "Gelu needs opset 20 and a target that takes it"
    inner = act.inputs[0]
    x = _erf_arg(inner) if act.op_type == "Erf" else _tanh_arg(inner)
    if x is None or elem_type(x) not in FLOATS:
        return "the argument is not the Gelu's scaled x (float)"
    t = act.outputs[0]
    add = sole_reader(t, "Add")
    if add is None or not close(scalar(other(add, t)), 1.0, 0.0):
        return "not followed by + 1"
    found = _half_product(x, add.outputs[0])
    if found is None:
        return "not multiplied by x * 0.5"
    out, nodes = found
    if not private([act, add, *nodes, *_arg_nodes(inner, x)], keep=out):
        return "an intermediate value is read outside the pattern"
    return x, out


def fuse_gelu(act: ir.Node, match: tuple[ir.Value, ir.Value], ctx: RuleContext) -> None:
    x, out = match
    attrs = [] if act.op_type == "Erf" else [ir.AttrString("approximate", "tanh")]
    fused = ir.Node("", "Gelu", [x], attrs, name=fusion(ctx).new_name("Gelu"))
    ctx.graph.insert_before(out.producer() or act, fused)
    fused.outputs[0].shape = out.shape
    fused.outputs[0].type = out.type
    replace(out, fused.outputs[0], "a Gelu pattern")
