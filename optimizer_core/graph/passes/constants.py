"""Constant normalization: ``Constant`` nodes become initializers of their graph.

Initializers are free at run time while a ``Constant`` is a node to schedule; every later pass
then reads constants one way. String and sparse constants are left as nodes.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from graphtrim import dtypes
from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass


def _liftable(node: ir.Node, ctx: RuleContext) -> Any:
    """The tensor of a Constant node that can become an initializer."""
    if len(node.outputs) != 1:
        return "not one output"
    out = node.outputs[0]
    if out.is_graph_output() or not out.name:
        # an output that is an initializer trips some runtimes inside subgraphs
        return "a graph output or unnamed"
    array = u.const_array(out)
    if array is None or array.dtype == object:
        return "not a numeric tensor"
    if "value" in node.attributes:
        tensor = node.attributes["value"].value
        if tensor.dtype == ir.DataType.STRING:
            return "a string tensor"
        return tensor
    return dtypes.tensor(array)


def _lift(node: ir.Node, tensor: Any, ctx: RuleContext) -> None:
    """Register ``tensor`` as an initializer under the output's name; the node goes."""
    out = node.outputs[0]
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
    ctx.graph.register_initializer(value)
    u.remove_nodes(ctx.graph, [node])


RULES: tuple[Rule, ...] = (
    Rule(
        "constant-to-initializer",
        "Constant(value=t) -> initializer t under the output's name (numeric tensors, not a "
        "graph output)",
        ("Constant",),
        _liftable,
        _lift,
    ),
)


class LiftConstants(RulePass):
    name = "lift-constants"
    summary = "turn Constant nodes into initializers"
    rules = RULES
