"""Control flow: an ``If`` whose condition is a constant is replaced by the branch it takes.

The branch's nodes and initializers move into the enclosing graph (renamed where a name is
taken), and the ``If`` outputs are replaced by the branch outputs. The passes themselves recurse
into every subgraph (``model.graphs()``), so bodies of ``Loop``/``Scan``/``If`` are optimized
like the main graph.
"""

from __future__ import annotations

import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass


class ConstantIfInlining(GraphtrimPass):
    name = "if-inline"
    summary = "inline the taken branch of an If with a constant condition"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            for node in u.nodes_in_order(graph):
                if node.graph is not graph or not u.is_op(node, "If"):
                    continue
                cond = u.const_array(node.inputs[0])
                if cond is None or cond.size != 1:
                    continue
                branch_name = "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"
                if branch_name not in node.attributes:
                    continue
                branch = node.attributes[branch_name].as_graph()
                if len(branch.outputs) != len(node.outputs):
                    continue
                if namer is None:
                    namer = u.NameGenerator(model)
                if self._inline(graph, node, branch, namer):
                    self.hit(f"if-{branch_name.split('_')[0]}")
                    changed = True
        return changed

    def _inline(
        self, graph: ir.Graph, node: ir.Node, branch: ir.Graph, namer: u.NameGenerator
    ) -> bool:
        # detach the outputs first: a branch initializer that is also a branch output stays
        # bound to the branch (and cannot move) while it is listed there
        outputs = list(branch.outputs)
        branch.outputs.clear()
        for name, init in list(branch.initializers.items()):
            branch.initializers.pop(name)
            init.name = namer(name)
            graph.register_initializer(init)
        moved = list(branch)
        for inner in moved:
            branch.remove(inner)
            for out in inner.outputs:
                if out.name:
                    out.name = namer(out.name)
        graph.insert_before(node, moved)
        for out, new in zip(node.outputs, outputs, strict=True):
            if not u.replace_value(out, new):
                # the branch output is an outer value that is also a graph output: copy it
                ident = ir.node("Identity", [new])
                graph.insert_before(node, ident)
                u.replace_value(out, ident.outputs[0])
        u.remove_nodes(graph, [node])
        return True
