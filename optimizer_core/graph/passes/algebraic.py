"""Algebraic simplification.

Exact rules (``algebraic``), applied only when broadcasting cannot change the output shape:

- ``x + 0 -> x``, ``0 + x -> x``, ``x - 0 -> x``, ``x * 1 -> x``, ``1 * x -> x``, ``x / 1 -> x``,
  ``x ** 1 -> x``
- ``Neg(Neg(x)) -> x``, ``Not(Not(x)) -> x``
- ``Transpose(Transpose(x, p), q) -> Transpose(x, p[q])`` and ``-> x`` when ``p[q]`` is the identity
- ``Reshape(R(x), s) -> Reshape(x, s)`` for ``R`` in Reshape/Flatten/Squeeze/Unsqueeze when ``s``
  copies no dim (no 0 entry): a Reshape reads only the element order, which ``R`` keeps.

Rules that round differently (``reassociate``, not in the ``safe`` preset; relative error of the
order of one ulp):

- ``(x * c1) * c2 -> x * (c1 * c2)`` and ``(x + c1) + c2 -> x + (c1 + c2)`` for constants whose
  product/sum is no larger than the larger of them (broadcasting never grows a constant)
- ``Reciprocal(Reciprocal(x)) -> x``
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass


def _broadcast_keeps_shape(x: ir.Value, c: ir.Value) -> bool:
    """Broadcasting ``x`` with constant ``c`` yields exactly the shape of ``x``."""
    c_arr = u.const_array(c)
    if c_arr is None:
        return False
    if c_arr.ndim == 0:
        return True
    x_dims = u.symbolic_dims(x)
    if x_dims is None or c_arr.ndim > len(x_dims):
        return False
    for cd, xd in zip(reversed(c_arr.shape), reversed(x_dims), strict=False):
        if cd != 1 and not (isinstance(xd, int) and xd == cd):
            return False
    return True


def _same_dtype(a: ir.Value, b: ir.Value) -> bool:
    return a.dtype is None or b.dtype is None or a.dtype == b.dtype


class AlgebraicSimplification(GraphtrimPass):
    name = "algebraic"
    summary = "x+0, x-0, x*1, x/1, x**1, double Neg/Not, Transpose pairs, Reshape chains"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for _graph, node in u.standard_nodes(model):
            rule = getattr(self, f"_rule_{node.op_type}", None)
            if rule is not None and rule(node, model):
                changed = True
        return changed

    def _neutral(self, node: ir.Node, operand: int, neutral: float, rule: str) -> bool:
        """Drop ``node`` when input ``operand`` is the neutral element for the other input."""
        if len(node.inputs) != 2:
            return False
        x, c = node.inputs[1 - operand], node.inputs[operand]
        if x is None or c is None or not u.is_all(c, neutral) or not _broadcast_keeps_shape(x, c):
            return False
        if not _same_dtype(x, node.outputs[0]):
            return False
        if u.replace_value(node.outputs[0], x):
            self.hit(rule)
            return True
        return False

    def _rule_Add(self, node: ir.Node, model: ir.Model) -> bool:
        return self._neutral(node, 1, 0, "x+0") or self._neutral(node, 0, 0, "0+x")

    def _rule_Sub(self, node: ir.Node, model: ir.Model) -> bool:
        return self._neutral(node, 1, 0, "x-0")

    def _rule_Mul(self, node: ir.Node, model: ir.Model) -> bool:
        return self._neutral(node, 1, 1, "x*1") or self._neutral(node, 0, 1, "1*x")

    def _rule_Div(self, node: ir.Node, model: ir.Model) -> bool:
        return self._neutral(node, 1, 1, "x/1")

    def _rule_Pow(self, node: ir.Node, model: ir.Model) -> bool:
        return self._neutral(node, 1, 1, "x**1")

    def _involution(self, node: ir.Node, rule: str) -> bool:
        x = node.inputs[0]
        producer = x.producer() if x is not None else None
        if producer is None or not u.is_op(producer, node.op_type) or producer.inputs[0] is None:
            return False
        if u.replace_value(node.outputs[0], producer.inputs[0]):
            self.hit(rule)
            return True
        return False

    def _rule_Neg(self, node: ir.Node, model: ir.Model) -> bool:
        return self._involution(node, "neg-neg")

    def _rule_Not(self, node: ir.Node, model: ir.Model) -> bool:
        return self._involution(node, "not-not")

    def _rule_Transpose(self, node: ir.Node, model: ir.Model) -> bool:
        x = node.inputs[0]
        inner = x.producer() if x is not None else None
        if inner is None or not u.is_op(inner, "Transpose") or inner.inputs[0] is None:
            return False
        r = u.rank(x)
        p = inner.attributes.get_ints("perm", None)
        q = node.attributes.get_ints("perm", None)
        if p is None or q is None:
            if r is None:
                return False
            p = list(p) if p is not None else list(reversed(range(r)))
            q = list(q) if q is not None else list(reversed(range(r)))
        if len(p) != len(q):
            return False
        composed = [int(p[i]) for i in q]
        src = inner.inputs[0]
        if composed == list(range(len(composed))) and u.replace_value(node.outputs[0], src):
            self.hit("transpose-transpose-cancel")
            return True
        # otherwise (also when a graph input would have to become a graph output) one
        # Transpose with the composed permutation replaces the pair
        node.replace_input_with(0, src)
        node.attributes["perm"] = ir.AttrInt64s("perm", composed)
        self.hit("transpose-transpose-compose")
        return True

    def _rule_Unsqueeze(self, node: ir.Node, model: ir.Model) -> bool:
        """Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, a')  (opset 13+: axes are an input)."""
        x = node.inputs[0]
        inner = x.producer() if x is not None else None
        if inner is None or not u.is_op(inner, "Unsqueeze") or inner.inputs[0] is None:
            return False
        if u.node_opset(node, model) < 13 or len(node.inputs) < 2 or len(inner.inputs) < 2:
            return False
        outer_axes, inner_axes = u.const_ints(node.inputs[1]), u.const_ints(inner.inputs[1])
        out_rank = u.rank(node.outputs[0])
        if outer_axes is None or inner_axes is None or out_rank is None:
            return False
        b = u.normalize_axes(outer_axes, out_rank)
        a = u.normalize_axes(inner_axes, out_rank - len(outer_axes))
        if a is None or b is None:
            return False
        # positions of the intermediate tensor inside the final one: those not inserted by b
        kept = [i for i in range(out_rank) if i not in set(b)]
        combined = sorted(set(b) | {kept[i] for i in a})
        graph = node.graph
        if graph is None:
            return False
        namer = u.NameGenerator(model)
        axes = u.add_initializer(graph, np.array(combined, dtype=np.int64), namer("unsqueeze_axes"))
        node.replace_input_with(0, inner.inputs[0])
        node.replace_input_with(1, axes)
        self.hit("unsqueeze-unsqueeze")
        return True

    def _rule_Reshape(self, node: ir.Node, model: ir.Model) -> bool:
        x = node.inputs[0]
        inner = x.producer() if x is not None else None
        if inner is None or not u.is_op(inner, "Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            return False
        if len(node.inputs) < 2 or inner.inputs[0] is None:
            return False
        shape = u.const_ints(node.inputs[1])
        if shape is None:
            return False
        if 0 in shape and not node.attributes.get_int("allowzero", 0):
            return False
        node.replace_input_with(0, inner.inputs[0])
        self.hit(f"{inner.op_type.lower()}-reshape")
        return True


class ReassociateConstants(GraphtrimPass):
    name = "reassociate"
    exact = False
    summary = "merge chains of constant Mul/Add; Reciprocal pairs (rounding may differ by an ulp)"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph in u.all_graphs(model):
            namer: u.NameGenerator | None = None
            for node in u.nodes_in_order(graph):
                if node.graph is None or not u.is_standard(node):
                    continue
                if node.op_type in ("Mul", "Add"):
                    if namer is None:
                        namer = u.NameGenerator(model)
                    changed |= self._chain(node, graph, namer)
                elif node.op_type == "Reciprocal":
                    x = node.inputs[0]
                    inner = x.producer() if x is not None else None
                    if (
                        u.is_op(inner, "Reciprocal")
                        and inner is not None
                        and inner.inputs[0] is not None
                    ):
                        if u.replace_value(node.outputs[0], inner.inputs[0]):
                            self.hit("reciprocal-reciprocal")
                            changed = True
        return changed

    def _chain(self, node: ir.Node, graph: ir.Graph, namer: u.NameGenerator) -> bool:
        if len(node.inputs) != 2:
            return False
        a, b = node.inputs
        if a is None or b is None:
            return False
        x, c2 = (a, b) if u.is_constant(b) else (b, a)
        if not u.is_constant(c2) or u.is_constant(x) or not u.single_consumer(x):
            return False
        inner = x.producer()
        if inner is None or not u.is_op(inner, node.op_type) or len(inner.inputs) != 2:
            return False
        ia, ib = inner.inputs
        if ia is None or ib is None:
            return False
        y, c1 = (ia, ib) if u.is_constant(ib) else (ib, ia)
        if not u.is_constant(c1) or u.is_constant(y):
            return False
        v1, v2 = u.const_array(c1), u.const_array(c2)
        if v1 is None or v2 is None or v1.dtype != v2.dtype or v1.dtype.kind not in "fiu":
            return False
        merged_shape = np.broadcast_shapes(v1.shape, v2.shape)
        if int(np.prod(merged_shape)) > max(v1.size, v2.size):
            return False
        with np.errstate(all="ignore"):
            merged = (v1 * v2) if node.op_type == "Mul" else (v1 + v2)
        merged = merged.astype(v1.dtype)
        if merged.dtype.kind == "f" and not np.all(np.isfinite(merged)):
            return False
        const = u.add_initializer(graph, merged, namer(f"{c2.name or 'c'}_merged"))
        node.replace_input_with(0, y)
        node.replace_input_with(1, const)
        self.hit(f"{node.op_type.lower()}-chain")
        return True
