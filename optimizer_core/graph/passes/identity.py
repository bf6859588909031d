"""Identity elimination: nodes whose output equals their input.

Rules (each exact; shapes must prove the no-op, symbolic dims count only when provably equal):

- ``Identity(x) -> x``
- ``Dropout(x)`` in inference mode (no training flag, mask unused) ``-> x``
- ``Cast(x, to=T) -> x`` and ``CastLike(x, y) -> x`` when ``x`` already has type ``T``
- ``Reshape(x, s) -> x`` when ``s`` reproduces the shape of ``x`` (0 copies a dim, -1 fills)
- ``Transpose(x, perm) -> x`` when ``perm`` is the identity
- ``Squeeze(Unsqueeze(x, a), a) -> x`` and ``Unsqueeze(Squeeze(x, a), a) -> x``
- ``Squeeze(x)`` without axes when ``x`` has no dim of size 1
- ``Expand(x, s) -> x`` when broadcasting ``x`` to ``s`` keeps the shape of ``x``
- ``Slice(x, ...) -> x`` when every sliced axis keeps all its elements with step 1
- ``Pad(x, pads) -> x`` when all pads are zero
- ``Concat(x) -> x`` with one input; ``Flatten(x) -> x`` when the result has the shape of ``x``
"""

from __future__ import annotations

import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass

INT64_MAX = 2**63 - 1

Found = tuple[str, ir.Value] | None


def _on_input(node: ir.Node, rule: str) -> Found:
    x = node.inputs[0]
    return None if x is None else (rule, x)


def _axes(node: ir.Node, model: ir.Model, input_index: int) -> list[int] | None:
    """The axes of Squeeze/Unsqueeze/Slice/Pad whether given as attribute or input; [] if absent."""
    if "axes" in node.attributes:
        return list(node.attributes["axes"].as_ints())
    if len(node.inputs) > input_index and node.inputs[input_index] is not None:
        return u.const_ints(node.inputs[input_index])
    return []


class IdentityElimination(GraphtrimPass):
    name = "identity"
    summary = "remove Identity, inference Dropout and no-op Cast/Reshape/Transpose/... nodes"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for _graph, node in u.standard_nodes(model):
            rule = getattr(self, f"_rule_{node.op_type}", None)
            if rule is None:
                continue
            found = rule(node, model)
            if found is None:
                continue
            rule_name, replacement = found
            if u.replace_value(node.outputs[0], replacement):
                self.hit(rule_name)
                changed = True
        return changed

    # --- rules: each returns (rule name, value equal to the node's output) or None

    def _rule_Identity(self, node: ir.Node, model: ir.Model) -> Found:
        return _on_input(node, "identity")

    def _rule_Dropout(self, node: ir.Node, model: ir.Model) -> Found:
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            return None
        if u.node_opset(node, model) < 12:
            is_test = node.attributes.get_int("is_test", 0)
            if u.node_opset(node, model) < 7 and not is_test:
                return None
            return _on_input(node, "dropout-inference")
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is None:
            return _on_input(node, "dropout-inference")
        flag = u.const_array(training)
        if flag is not None and not bool(flag.reshape(-1)[0]):
            return _on_input(node, "dropout-inference")
        return None

    def _rule_Cast(self, node: ir.Node, model: ir.Model) -> Found:
        x = node.inputs[0]
        to = node.attributes.get_int("to", None)
        if x is None or x.dtype is None or to is None:
            return None
        return _on_input(node, "cast-same-type") if int(x.dtype) == int(to) else None

    def _rule_CastLike(self, node: ir.Node, model: ir.Model) -> Found:
        x, like = node.inputs[0], node.inputs[1]
        if x is None or like is None or x.dtype is None or like.dtype is None:
            return None
        return _on_input(node, "cast-same-type") if x.dtype == like.dtype else None

    def _rule_Reshape(self, node: ir.Node, model: ir.Model) -> Found:
        if len(node.inputs) < 2:
            return None
        x_dims = u.symbolic_dims(node.inputs[0])
        target = u.const_ints(node.inputs[1])
        if x_dims is None or target is None or len(target) != len(x_dims):
            return None
        allowzero = node.attributes.get_int("allowzero", 0)
        minus_one = 0
        for t, d in zip(target, x_dims, strict=True):
            if t == -1:
                minus_one += 1
            elif t == 0 and not allowzero:
                continue
            elif not (isinstance(d, int) and d == t):
                return None
        # with every other dim equal, a single -1 can only be the remaining dim
        return _on_input(node, "reshape-noop") if minus_one <= 1 else None

    def _rule_Transpose(self, node: ir.Node, model: ir.Model) -> Found:
        perm = node.attributes.get_ints("perm", None)
        r = u.rank(node.inputs[0])
        if perm is None:
            return _on_input(node, "transpose-noop") if r is not None and r <= 1 else None
        return _on_input(node, "transpose-noop") if list(perm) == list(range(len(perm))) else None

    def _rule_Squeeze(self, node: ir.Node, model: ir.Model) -> Found:
        x = node.inputs[0]
        axes = _axes(node, model, 1)
        if axes is None or x is None:
            return None
        producer = x.producer()
        if axes and u.is_op(producer, "Unsqueeze") and producer is not None:
            inner = _axes(producer, model, 1)
            r = u.rank(x)
            if inner is not None and r is not None:
                a = u.normalize_axes(axes, r)
                b = u.normalize_axes(inner, r)
                if a is not None and b is not None and sorted(a) == sorted(b):
                    src = producer.inputs[0]
                    if src is not None:
                        return "unsqueeze-squeeze", src
            return None
        if not axes:
            d = u.dims(x)
            if d is not None and all(v is not None and v != 1 for v in d):
                return _on_input(node, "squeeze-noop")
        return None

    def _rule_Unsqueeze(self, node: ir.Node, model: ir.Model) -> Found:
        x = node.inputs[0]
        axes = _axes(node, model, 1)
        producer = x.producer() if x is not None else None
        if not axes or not u.is_op(producer, "Squeeze") or producer is None:
            return None
        inner = _axes(producer, model, 1)
        out_rank = u.rank(node.outputs[0])
        src = producer.inputs[0]
        if not inner or out_rank is None or src is None:
            return None
        a = u.normalize_axes(axes, out_rank)
        b = u.normalize_axes(inner, out_rank)
        if a is not None and b is not None and sorted(a) == sorted(b):
            return "squeeze-unsqueeze", src
        return None

    def _rule_Expand(self, node: ir.Node, model: ir.Model) -> Found:
        x_dims = u.symbolic_dims(node.inputs[0])
        shape = u.const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if x_dims is None or shape is None or len(shape) > len(x_dims):
            return None
        for s, d in zip(reversed(shape), reversed(x_dims), strict=False):
            if s == 1:
                continue
            if not (isinstance(d, int) and d == s):
                return None
        return _on_input(node, "expand-noop")

    def _rule_Slice(self, node: ir.Node, model: ir.Model) -> Found:
        if u.node_opset(node, model) < 10 or len(node.inputs) < 3:
            return None
        x_dims = u.dims(node.inputs[0])
        starts = u.const_ints(node.inputs[1])
        ends = u.const_ints(node.inputs[2])
        if x_dims is None or starts is None or ends is None:
            return None
        r = len(x_dims)
        axes = _axes(node, model, 3) or list(range(len(starts)))
        steps = (
            u.const_ints(node.inputs[4])
            if len(node.inputs) > 4 and node.inputs[4] is not None
            else None
        )
        if len(node.inputs) > 4 and node.inputs[4] is not None and steps is None:
            return None
        steps = steps or [1] * len(starts)
        norm = u.normalize_axes(axes, r)
        if norm is None or not (len(norm) == len(starts) == len(ends) == len(steps)):
            return None
        for ax, s, e, st in zip(norm, starts, ends, steps, strict=True):
            if st != 1:
                return None
            d = x_dims[ax]
            if s != 0 and not (d is not None and s <= -d):
                return None
            if e < INT64_MAX // 2 and not (d is not None and e >= d):
                return None
        return _on_input(node, "slice-noop")

    def _rule_Pad(self, node: ir.Node, model: ir.Model) -> Found:
        if "pads" in node.attributes:
            pads = list(node.attributes["pads"].as_ints())
        elif len(node.inputs) > 1:
            pads = u.const_ints(node.inputs[1])  # type: ignore[assignment]
        else:
            return None
        if pads is None:
            return None
        return _on_input(node, "pad-noop") if all(p == 0 for p in pads) else None

    def _rule_Concat(self, node: ir.Node, model: ir.Model) -> Found:
        return (
            _on_input(node, "concat-single")
            if len(node.inputs) == 1 and node.inputs[0] is not None
            else None
        )

    def _rule_Flatten(self, node: ir.Node, model: ir.Model) -> Found:
        x_dims = u.symbolic_dims(node.inputs[0])
        if x_dims is None or len(x_dims) != 2:
            return None
        axis = node.attributes.get_int("axis", 1)
        # rank-2 input: axis 1 keeps (d0, d1); axis 0 gives (1, d0*d1); axis 2 gives (d0*d1, 1)
        if axis in (1, -1):
            return _on_input(node, "flatten-noop")
        if axis in (0, -2) and x_dims[0] == 1:
            return _on_input(node, "flatten-noop")
        if axis == 2 and x_dims[1] == 1:
            return _on_input(node, "flatten-noop")
        return None
