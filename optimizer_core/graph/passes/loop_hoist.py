"""Hoisting loop-invariant nodes out of ``Loop`` and ``Scan`` bodies (exact: the same ops on the
same operands, computed once).

A node of a ``Loop`` or ``Scan`` body that is deterministic, standard-domain, without subgraphs
and whose operands are all defined outside the body (outer-scope values, body constants, or
outputs of other such nodes) computes the same value in every iteration: it moves in front of
the Loop/Scan and the body reads its result as an outer-scope value. The body's own inputs
(iteration number, condition, carried and scan values) are never such operands. ONNX ops are
pure, so computing the value once even when the loop runs zero times changes no output. A hoisted
value that is also a body output is returned through an ``Identity`` (a subgraph output must be
defined in the subgraph); ``Identity`` nodes and nodes reading only constants are hoisted only to
serve a hoisted node (folding takes care of constants, and an ``Identity`` returning an outer
value is the one form a body output of an outer value may take).
"""

from __future__ import annotations

from typing import Any, cast

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._loops import LoopRulePass, body_of, typed_like
from graphtrim.graph.rules import Rule, RuleContext


def _movable_constant(value: ir.Value, body: ir.Graph) -> bool:
    return (
        value.graph is body
        and value.is_initializer()
        and not value.is_graph_input()
        and not value.is_graph_output()
    )


def _invariant_nodes(body: ir.Graph) -> list[ir.Node]:
    invariant: list[ir.Node] = []
    invariant_values: set[ir.Value] = set()
    outer_dependent: set[ir.Value] = set()  # invariant values computed from outer values
    seeds: set[ir.Node] = set()
    for node in body:
        if (
            not u.is_standard(node)
            or node.op_type in u.NONDETERMINISTIC_OPS
            or u.has_subgraph(node)
        ):
            continue
        ok = True
        depends_on_outer = False
        for v in node.inputs:
            if v is None:
                continue
            if v.graph is None:
                ok = False
            elif v.graph is not body:
                depends_on_outer = True
            elif v in invariant_values:
                depends_on_outer = depends_on_outer or v in outer_dependent
            elif not _movable_constant(v, body):
                ok = False
            if not ok:
                break
        if not ok:
            continue
        invariant.append(node)
        invariant_values.update(node.outputs)
        if depends_on_outer:
            outer_dependent.update(node.outputs)
            if not u.is_op(node, "Identity"):
                seeds.add(node)
    # a seed moves with the invariant nodes it reads
    chosen: set[ir.Node] = set()
    for node in reversed(invariant):
        if node in seeds or any(user in chosen for out in node.outputs for user, _ in out.uses()):
            chosen.add(node)
    return [n for n in invariant if n in chosen]


def _check(loop: ir.Node, ctx: RuleContext) -> list[ir.Node] | str:
    """The body's invariant nodes (in body order), or why there are none to hoist."""
    body = body_of(loop)
    if body is None:
        return "no body"
    hoisted = _invariant_nodes(body)
    return hoisted or "no invariant node reads an outer value"


def _hoist(loop: ir.Node, nodes: list[ir.Node], ctx: RuleContext) -> None:
    graph = ctx.graph
    body = body_of(loop)
    assert body is not None
    namer = cast("LoopInvariantHoisting", ctx.pass_).names(ctx.model)
    # a body output must be defined in the body: hoisted values it returns go through an
    # Identity that stays
    produced = {out for n in nodes for out in n.outputs}
    for index, value in enumerate(list(body.outputs)):
        if value in produced:
            ident = ir.node("Identity", [value])
            out = ident.outputs[0]
            out.name = namer(f"{value.name or 'out'}_body")
            typed_like(out, value)
            body.outputs[index] = out
            body.append(ident)
    for node in nodes:
        for v in node.inputs:
            if v is not None and v.name and _movable_constant(v, body):
                body.initializers.pop(v.name)
                v.name = namer(v.name)
                graph.register_initializer(v)
    body.remove(nodes)
    for node in nodes:
        for out in node.outputs:
            out.name = namer(out.name or "hoisted")
    graph.insert_before(loop, nodes)


_MATH = (
    "a body node f(a, b, ...) whose operands are outer-scope values, body constants or outputs "
    "of such nodes, with at least one outer value behind it, deterministic, standard-domain, "
    "without subgraphs -> computed once in front of the {op}, the body reading its result "
    "(ONNX ops are pure: the same value in every iteration, and none when it runs zero times); "
    "counted once per hoisted node"
)

RULES: tuple[Rule, ...] = (
    Rule("loop-hoist", _MATH.format(op="Loop"), ("Loop",), _check, _hoist),
    Rule("scan-hoist", _MATH.format(op="Scan"), ("Scan",), _check, _hoist),
)


class LoopInvariantHoisting(LoopRulePass):
    # innermost first: what leaves an inner body may then leave the enclosing one
    name = "loop-hoist"
    summary = "move loop-invariant nodes of Loop and Scan bodies in front of the loop"
    rules = RULES

    def counted(self, rule: Rule, match: Any) -> int:
        """One count per node moved."""
        return len(match)
