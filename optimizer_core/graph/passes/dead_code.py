"""Dead-code elimination: nodes, initializers and opset imports nothing reads.

A node is dead when none of its outputs is read by another node or is an output of its graph.
Nodes without outputs exist only for their effect and are kept, as are nodes of custom domains
that have no outputs. Initializers that nothing reads go too, unless they are graph inputs (then
they are part of the model's interface).
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.rules import Rule

# whole-graph rules: nodes in reverse order, so a removal can make its producers dead too
RULES: tuple[Rule, ...] = (
    Rule(
        "dead-node",
        "a node none of whose outputs is read or a graph output -> removed (nodes without "
        "outputs stay)",
    ),
    Rule(
        "unused-initializer",
        "an initializer nothing reads that is no graph input or output -> removed",
    ),
    Rule("unused-opset", "an opset import of a custom domain no node or function uses -> removed"),
)


class DeadCodeElimination(GraphtrimPass):
    name = "dead-code"
    summary = "remove nodes, initializers and opset imports that nothing reads"
    rules = RULES
    sweeps_dead = False

    def apply(self, model: ir.Model) -> bool:
        changed = False
        for graph in u.all_graphs(model):
            # reverse order: removing a consumer can make its producers dead in the same sweep
            for node in reversed(list(graph)):
                if node.graph is graph and u.is_dead(node):
                    u.remove_nodes(graph, [node])
                    self.hit("dead-node")
                    changed = True
            for name, init in list(graph.initializers.items()):
                if not init.uses() and not init.is_graph_output() and not init.is_graph_input():
                    graph.initializers.pop(name)
                    self.hit("unused-initializer")
                    changed = True
        changed |= self._remove_unused_opsets(model)
        return changed

    def _remove_unused_opsets(self, model: ir.Model) -> bool:
        used = {node.domain for graph in u.all_graphs(model) for node in graph}
        for function in model.functions.values():
            used.add(function.domain)
            used.update(node.domain for node in function)
        changed = False
        for domain in list(model.opset_imports):
            if domain not in u.STANDARD_DOMAINS and domain not in used:
                del model.opset_imports[domain]
                self.hit("unused-opset")
                changed = True
        return changed
