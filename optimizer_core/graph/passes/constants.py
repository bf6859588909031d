"""Constant normalization: ``Constant`` nodes become initializers of their graph.

Initializers are free at run time while a ``Constant`` is a node to schedule; every later pass
then reads constants one way. String and sparse constants are left as nodes.
"""

from __future__ import annotations

import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass


class LiftConstants(GraphtrimPass):
    name = "lift-constants"
    summary = "turn Constant nodes into initializers"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph in u.all_graphs(model):
            for node in u.nodes_in_order(graph):
                if not u.is_op(node, "Constant") or len(node.outputs) != 1:
                    continue
                out = node.outputs[0]
                if out.is_graph_output() or not out.name:
                    # an output that is an initializer trips some runtimes inside subgraphs
                    continue
                array = u.const_array(out)
                if array is None or array.dtype == object:
                    continue
                if "value" in node.attributes:
                    tensor = node.attributes["value"].value
                    if tensor.dtype == ir.DataType.STRING:
                        continue
                else:
                    tensor = ir.tensor(array)
                name = out.name
                out.name = None
                value = ir.Value(
                    name=name,
                    const_value=tensor,
                    shape=ir.Shape(tensor.shape.numpy()),
                    type=ir.TensorType(tensor.dtype),
                )
                out.replace_all_uses_with(value)
                tensor.name = name
                graph.register_initializer(value)
                u.remove_nodes(graph, [node])
                self.hit("constant-to-initializer")
                changed = True
        return changed
