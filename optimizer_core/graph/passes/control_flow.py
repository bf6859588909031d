"""Control flow: an ``If`` whose condition is a constant is replaced by the branch it takes.

The branch's nodes and initializers move into the enclosing graph (renamed where a name is
taken), and the ``If`` outputs are replaced by the branch outputs. The passes themselves recurse
into every subgraph (``model.graphs()``), so bodies of ``Loop``/``Scan``/``If`` are optimized
like the main graph.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass


def _taken(branch_name: str, taken: bool) -> Callable[[ir.Node, RuleContext], ir.Graph | str]:
    """Check: the If's condition is a constant ``taken`` and ``branch_name`` can replace it."""

    def check(node: ir.Node, ctx: RuleContext) -> ir.Graph | str:
        cond = u.const_array(node.inputs[0])
        if cond is None or cond.size != 1:
            return "the condition is not a constant scalar"
        if bool(cond.reshape(-1)[0]) != taken:
            return f"the condition is {not taken}"
        if branch_name not in node.attributes:
            return f"no {branch_name}"
        branch = node.attributes[branch_name].as_graph()
        if len(branch.outputs) != len(node.outputs):
            return "the branch has another number of outputs"
        return branch

    return check


def _inline(node: ir.Node, branch: ir.Graph, ctx: RuleContext) -> None:
    """Move the branch's initializers and nodes before the If (renamed where a name is taken)
    and make the readers of the If's outputs read the branch's outputs."""
    assert isinstance(ctx.pass_, ConstantIfInlining)
    graph = ctx.graph
    namer = ctx.pass_.names(ctx.model)
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


RULES: tuple[Rule, ...] = (
    Rule(
        "if-then",
        "If(true, then_branch, else_branch) -> then_branch's nodes, its outputs for the If's",
        ("If",),
        _taken("then_branch", True),
        _inline,
    ),
    Rule(
        "if-else",
        "If(false, then_branch, else_branch) -> else_branch's nodes, its outputs for the If's",
        ("If",),
        _taken("else_branch", False),
        _inline,
    ),
)


class ConstantIfInlining(RulePass):
    name = "if-inline"
    summary = "inline the taken branch of an If with a constant condition"
    rules = RULES
