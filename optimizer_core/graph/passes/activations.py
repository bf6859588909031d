"""Redundant activations.

Rules (exact for non-NaN inputs):

- ``Relu(Relu(x)) -> Relu(x)``; more generally ``Relu(y) -> y`` when ``y`` is already
  non-negative: produced by Relu, Sigmoid, Softmax, Abs, Exp, Softplus, or Clip/Max with a
  lower bound >= 0.
- ``Clip(y, lo, hi) -> y`` when ``lo <= 0`` and there is no upper bound, for non-negative ``y``
  (a Clip with lo <= 0 cannot change a non-negative value).
- ``Clip(Relu(x), lo >= 0, hi) -> Clip(x, lo, hi)``: the Clip already clamps below at lo.
- ``Clip(Clip(x, a1, b1), a2, b2) -> Clip(x, max(a1, a2), min(b1, b2))`` when the intervals
  overlap (``max(a1, a2) <= min(b1, b2)``) and the inner Clip has no other reader.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass

_NON_NEGATIVE_OPS = frozenset({"Relu", "Sigmoid", "Softmax", "Abs", "Exp", "Softplus"})


def _clip_bounds(node: ir.Node, model: ir.Model) -> tuple[float | None, float | None] | None:
    """(lo, hi) of a Clip, None for an absent bound; None when a bound is not constant."""
    if u.node_opset(node, model) < 11:
        lo = node.attributes.get_float("min", None)
        hi = node.attributes.get_float("max", None)
        return lo, hi
    bounds: list[float | None] = []
    for i in (1, 2):
        v = node.inputs[i] if len(node.inputs) > i else None
        if v is None:
            bounds.append(None)
            continue
        arr = u.const_array(v)
        if arr is None or arr.size != 1:
            return None
        bounds.append(float(arr.reshape(-1)[0]))
    return bounds[0], bounds[1]


def is_non_negative(value: ir.Value, model: ir.Model) -> bool:
    node = value.producer()
    if node is None or not u.is_standard(node):
        arr = u.const_array(value)
        return (
            arr is not None and arr.dtype.kind in "fiu" and arr.size > 0 and bool(np.all(arr >= 0))
        )
    if node.op_type in _NON_NEGATIVE_OPS:
        return True
    if node.op_type == "Clip":
        b = _clip_bounds(node, model)
        return b is not None and b[0] is not None and b[0] >= 0
    return False


class RedundantActivations(GraphtrimPass):
    name = "activations"
    summary = "remove Relu/Clip that cannot change their input; merge nested Clips"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph, node in u.standard_nodes(model):
            if node.op_type == "Relu":
                changed |= self._relu(node, model)
            elif node.op_type == "Clip":
                changed |= self._clip(node, model, graph)
        return changed

    def _relu(self, node: ir.Node, model: ir.Model) -> bool:
        x = node.inputs[0]
        if x is None or not is_non_negative(x, model):
            return False
        if u.replace_value(node.outputs[0], x):
            self.hit("relu-after-non-negative")
            return True
        return False

    def _clip(self, node: ir.Node, model: ir.Model, graph: ir.Graph) -> bool:
        x = node.inputs[0]
        bounds = _clip_bounds(node, model)
        if x is None or bounds is None:
            return False
        lo, hi = bounds
        if hi is None and (lo is None or lo <= 0) and is_non_negative(x, model):
            if u.replace_value(node.outputs[0], x):
                self.hit("clip-after-non-negative")
                return True
            return False
        producer = x.producer()
        if producer is None or not u.single_consumer(x):
            return False
        if (
            u.is_op(producer, "Relu")
            and lo is not None
            and lo >= 0
            and producer.inputs[0] is not None
        ):
            node.replace_input_with(0, producer.inputs[0])
            self.hit("relu-into-clip")
            return True
        if u.is_op(producer, "Clip") and u.node_opset(node, model) >= 11:
            inner = _clip_bounds(producer, model)
            if inner is None or producer.inputs[0] is None:
                return False
            los = [b for b in (lo, inner[0]) if b is not None]
            his = [b for b in (hi, inner[1]) if b is not None]
            new_lo = max(los) if los else None
            new_hi = min(his) if his else None
            if new_lo is not None and new_hi is not None and new_lo > new_hi:
                return False
            if x.dtype is not None:
                dtype = x.dtype.numpy()
            else:  # type unknown (e.g. after a custom op): the bounds have the data's type
                bound_arrays = [u.const_array(v) for n in (node, producer) for v in n.inputs[1:]]
                dtype = next((a.dtype for a in bound_arrays if a is not None), np.dtype(np.float32))
            namer = u.NameGenerator(model) if (new_lo is not None or new_hi is not None) else None
            inputs: list[ir.Value | None] = [producer.inputs[0]]
            for bound, tag in ((new_lo, "min"), (new_hi, "max")):
                if bound is None:
                    inputs.append(None)
                else:
                    assert namer is not None
                    inputs.append(
                        u.add_initializer(
                            graph,
                            np.array(bound, dtype=dtype),
                            namer(f"{node.name or 'clip'}_{tag}"),
                        )
                    )
            while inputs and inputs[-1] is None:
                inputs.pop()
            for i in range(len(node.inputs)):
                node.replace_input_with(i, None)
            node.resize_inputs(len(inputs))
            for i, v in enumerate(inputs):
                node.replace_input_with(i, v)
            self.hit("clip-clip")
            return True
        return False
