"""Scalar inputs: ops whose definition takes a scalar get a rank-0 value.

``Range``'s start, limit and delta, the window ops' size, ``DFT``'s dft_length and axis and the
like are scalars by definition, yet onnxruntime's kernels also accept a one-element tensor of
rank 1, and a model may feed one (onnx's own function body of ``AffineGrid`` feeds ``Range``
from ``Split`` outputs of shape [1]). Such a model loads only while static inference cannot see
the rank: once a rewrite makes the value a constant, or moves it out of an ``If`` branch
(constant folding of the condition, ``If`` inlining, the runtime's own folding at load), the
runtime's shape inference rejects the model ("Input to 'Range' op should be scalars").

This pass is the repair: an input of known rank >= 1 whose dims are all 1 or unknown is replaced
by a scalar of the same value (a constant is rewritten as a rank-0 constant, anything else goes
through ``Squeeze`` without axes, which drops every dimension of size 1). It changes no numbers:
a tensor with more than one element fails in the kernel already. The fixed-point driver runs it
after every pass that changed the model, so each intermediate model loads too.
"""

from __future__ import annotations

import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass

# op -> positions of the inputs its definition declares as scalars (0-D tensors)
SCALAR_INPUTS: dict[str, tuple[int, ...]] = {
    "Range": (0, 1, 2),
    "BlackmanWindow": (0,),
    "HammingWindow": (0,),
    "HannWindow": (0,),
    "DFT": (1, 2),  # dft_length; axis (an input from opset 20)
    "STFT": (1, 3),  # frame_step, frame_length
    "MelWeightMatrix": (0, 1, 2, 3, 4),
    "CumSum": (1,),  # axis
    "Trilu": (1,),  # k
    "SequenceAt": (1,),  # position
    "SequenceErase": (1,),
    "SequenceInsert": (2,),
}


def _one_element_rank_n(value: ir.Value) -> bool:
    """Known rank >= 1 and no dim known to differ from 1."""
    d = u.dims(value)
    return bool(d) and all(x is None or x == 1 for x in d)  # type: ignore[union-attr]


class ScalarInputs(GraphtrimPass):
    name = "scalar-inputs"
    summary = "feed ops that take scalars (Range, DFT, window sizes) rank-0 values"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            for node in u.nodes_in_order(graph):
                positions = SCALAR_INPUTS.get(node.op_type)
                if positions is None or not u.is_standard(node) or node.graph is not graph:
                    continue
                for i in positions:
                    value = node.inputs[i] if i < len(node.inputs) else None
                    if value is None or not _one_element_rank_n(value):
                        continue
                    if namer is None:
                        namer = u.NameGenerator(model)
                    node.replace_input_with(i, self._scalar(graph, node, value, namer))
                    self.hit("scalar-input")
                    changed = True
        return changed

    def _scalar(
        self, graph: ir.Graph, node: ir.Node, value: ir.Value, namer: u.NameGenerator
    ) -> ir.Value:
        array = u.const_array(value)
        if array is not None and array.size == 1:
            return u.add_initializer(graph, array.reshape(()), namer(f"{value.name}_scalar"))
        squeeze = ir.node("Squeeze", [value])
        out = squeeze.outputs[0]
        out.name = namer(f"{value.name}_scalar")
        out.shape = ir.Shape([])
        if value.type is not None:
            out.type = value.type
        graph.insert_before(node, squeeze)
        return out
