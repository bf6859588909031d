"""Outputs that depend on a random op, whose values no two runs share.

``RandomNormal``, ``RandomUniform``, their ``*Like`` forms, ``Bernoulli`` and ``Multinomial``
draw new numbers on every run unless seeded; even seeded, onnxruntime advances the generator
per run, and an optimized graph may draw in a different order. ``Dropout`` draws a mask when its
``training_mode`` input is present and not a constant false. Every value computed from such an
op, through any number of nodes, subgraphs (If / Loop / Scan bodies) and model-local functions,
is random: verification compares those outputs by shape and dtype only.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u

# the ops the passes never fold, merge or deduplicate, for the same reason
RANDOM_OPS = u.NONDETERMINISTIC_OPS

_FunctionKey = tuple[str, str, str]


def _random_op(node: ir.Node, model: ir.Model) -> bool:
    if not u.is_standard(node):
        return False
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type == "Dropout":
        if u.node_opset(node, model) < 12:  # is_test before opset 7, inference only from 7
            return u.node_opset(node, model) < 7 and not node.attributes.get_int("is_test", 0)
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is None:  # absent: inference
            return False
        flag = u.const_array(training)
        return flag is None or bool(flag.reshape(-1).any())
    return False


class _Scan:
    def __init__(self, model: ir.Model):
        self.model = model
        self.functions: dict[_FunctionKey, ir.Function] = dict(model.functions)
        self.function_origin: dict[_FunctionKey, str | None] = {}

    def function(self, key: _FunctionKey) -> str | None:
        """The random op a call of this model-local function may run, if any."""
        if key not in self.function_origin:
            self.function_origin[key] = None  # a recursive call adds nothing
            func = self.functions[key]
            self.function_origin[key] = self.nodes(func, {})
        return self.function_origin[key]

    def nodes(self, graph: ir.Graph | ir.Function, tainted: dict[str, str]) -> str | None:
        """Mark in ``tainted`` (value name -> random op type) every value of ``graph`` computed
        from a random op; return the first random op found, if any."""
        found: str | None = None
        for node in graph:
            origin: str | None = node.op_type if _random_op(node, self.model) else None
            for inp in node.inputs:
                if origin is None and inp is not None and inp.name in tainted:
                    origin = tainted[inp.name]
            key = (node.domain, node.op_type, node.overload)
            if origin is None and key in self.functions:
                origin = self.function(key)
            for sub in u.subgraphs_of(node):
                # a body reads outer values by name: it sees, and adds to, the same map
                inner = self.nodes(sub, tainted)
                origin = origin or inner
            if origin is not None:
                found = found or origin
                for out in node.outputs:
                    if out.name:
                        tainted[out.name] = origin
        return found


def random_outputs(model: ir.Model) -> dict[str, str]:
    """Graph outputs computed from a random op: output name -> the op type it depends on."""
    tainted: dict[str, str] = {}
    _Scan(model).nodes(model.graph, tainted)
    return {
        out.name: tainted[out.name]
        for out in model.graph.outputs
        if out.name is not None and out.name in tainted
    }
