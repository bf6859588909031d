"""Sibling MatMuls that read the same input merged into one (portable: standard ONNX ops only).

``MatMul(A, W1), ..., MatMul(A, Wn)`` with constant rank-2 weights ``Wi: [K, Ni]`` ->
``Split(MatMul(A, Concat(W1, ..., Wn, axis=1)), [N1, ..., Nn], axis=-1)``: every output column
is the same dot product as before, so only the kernel's summation order can differ (a relative
error around 1e-7 in float32). When every sibling's only reader is ``Add`` of a constant bias
``bi: [Ni]``, the biases are concatenated too and one Add serves all of them.

This is the query/key/value projection of attention: three matrix products become one, which is
faster on every runtime (one pass over ``A``) and, for dynamic int8 quantization, quantizes ``A``
once instead of three times. ``n`` MatMuls (and ``n`` Adds) become one MatMul, one Add and one
Split. The concatenated weight is a new tensor: groups whose weights total more than
``fold_max_tensor_bytes`` are left alone, and a weight read by anything else is never merged.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.rules import Rule

_SIBLINGS = (
    "for constant rank-2 weights Wi: [K, Ni] of one float type read only there, totalling at "
    "most fold_max_tensor_bytes (opset 13+; only the summation order can differ)"
)

# whole-graph rules: siblings are grouped by the input they read, then merged group by group
RULES: tuple[Rule, ...] = (
    Rule(
        "matmul-siblings",
        "MatMul(A, W1), .., MatMul(A, Wn) -> Split(MatMul(A, Concat(W1, .., Wn, axis=1)), "
        f"[N1, .., Nn], axis=-1) {_SIBLINGS}",
    ),
    Rule(
        "matmul-siblings-bias",
        "Add(MatMul(A, Wi), bi) for i = 1..n -> Split(Add(MatMul(A, Concat(W1, .., Wn, axis=1)), "
        f"Concat(b1, .., bn)), [N1, .., Nn], axis=-1) when each MatMul's only reader adds a "
        f"constant bias bi: [Ni], {_SIBLINGS}",
    ),
)


class SiblingMatMulFusion(GraphtrimPass):
    name = "fuse-siblings"
    exact = False
    summary = "MatMuls with constant weights that read the same input merged into one + Split"
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        opset = u.opset_version(model)
        if opset < 13:  # Split takes its sizes as an input from opset 13
            return False
        changed = False
        namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            groups: dict[int, list[ir.Node]] = {}
            for node in graph:
                if not u.is_op(node, "MatMul") or node.inputs[0] is None:
                    continue
                if self._weight(node) is not None:
                    groups.setdefault(id(node.inputs[0]), []).append(node)
            for nodes in groups.values():
                if len(nodes) < 2:
                    continue
                namer = namer or u.NameGenerator(model)
                changed |= self._merge(nodes, graph, namer)
        return changed

    @staticmethod
    def _weight(node: ir.Node) -> np.ndarray | None:
        w_val = node.inputs[1]
        if w_val is None or not u.is_constant(w_val) or w_val.is_graph_output():
            return None
        if any(user is not node for user, _ in w_val.uses()):
            return None
        shape = u.static_shape(w_val)
        if shape is None or len(shape) != 2:
            return None
        return u.const_array(w_val)

    @staticmethod
    def _bias(node: ir.Node, n: int, dtype: np.dtype) -> tuple[ir.Node, np.ndarray] | None:
        y = node.outputs[0]
        if y.is_graph_output() or len(y.uses()) != 1:
            return None
        add = next(iter(y.uses()))[0]
        if not u.is_op(add, "Add") or len(add.inputs) != 2:
            return None
        other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
        arr = u.const_array(other)
        if arr is None or arr.dtype != dtype or arr.shape != (n,):
            return None
        return add, arr

    @staticmethod
    def _merged_shape(one: ir.Value, width: int) -> ir.Shape | None:
        """The shape of one sibling's output with the last dim widened to all of them."""
        if one.shape is None or len(one.shape) == 0:
            return None
        return ir.Shape([*one.shape.dims[:-1], width])

    def _merge(self, nodes: list[ir.Node], graph: ir.Graph, namer: u.NameGenerator) -> bool:
        weights = [self._weight(n) for n in nodes]
        first = weights[0]
        if first is None or first.dtype.kind != "f":
            return False
        pairs = [
            (n, w)
            for n, w in zip(nodes, weights, strict=True)
            if w is not None and w.dtype == first.dtype and w.shape[0] == first.shape[0]
        ]
        if len(pairs) < 2:
            return False
        if sum(w.nbytes for _, w in pairs) > self.options.fold_max_tensor_bytes:
            return False
        nodes = [n for n, _ in pairs]
        widths = [int(w.shape[1]) for _, w in pairs]
        biases = [self._bias(n, w.shape[1], first.dtype) for n, w in pairs]
        with_bias = all(b is not None for b in biases)
        # the merged nodes go where the last sibling was, so every reader of A already exists;
        # the readers of the siblings' outputs come after their own sibling, possibly before the
        # last one: move the merged block before the first sibling instead
        anchor = nodes[0]
        a = anchor.inputs[0]
        assert a is not None
        w_cat = np.concatenate([w for _, w in pairs], axis=1)
        w_val = u.add_initializer(graph, w_cat, namer("merged_weight"))
        mm = ir.Node("", "MatMul", [a, w_val], name=namer("MatMul_merged"))
        graph.insert_before(anchor, mm)
        y = mm.outputs[0]
        replaced = [n.outputs[0] for n in nodes]
        merged_shape = self._merged_shape(replaced[0], sum(widths))
        # typed here, so no shape inference has to run for the new values
        y.shape, y.type = merged_shape, replaced[0].type
        if with_bias:
            b_cat = np.concatenate([b[1] for b in biases if b is not None])
            b_val = u.add_initializer(graph, b_cat, namer("merged_bias"))
            add = ir.Node("", "Add", [y, b_val], name=namer("Add_merged"))
            graph.insert_before(anchor, add)
            y = add.outputs[0]
            y.shape, y.type = merged_shape, replaced[0].type
            replaced = [b[0].outputs[0] for b in biases if b is not None]
        sizes = u.add_initializer(graph, np.array(widths, dtype=np.int64), namer("split_sizes"))
        split = ir.Node("", "Split", [y, sizes], [ir.AttrInt64("axis", -1)], num_outputs=len(nodes))
        graph.insert_before(anchor, split)
        for old, new in zip(replaced, split.outputs, strict=True):
            new.shape = old.shape
            new.type = old.type
            if not u.replace_value(old, new):  # pragma: no cover - has a producer
                raise RuntimeError("cannot reroute a merged MatMul output")
        self.hit("matmul-siblings-bias" if with_bias else "matmul-siblings")
        return True
