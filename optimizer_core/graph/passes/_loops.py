"""Helpers shared by the Loop passes (``loop_unroll``, ``loop_hoist``, ``loop_fuse``)."""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import RuleContext, RulePass


def loops_innermost_first(model: ir.Model, *ops: str) -> Iterator[tuple[ir.Graph, ir.Node]]:
    """``(graph, node)`` for each node of the op types ``ops``, innermost graphs first (what a
    rewrite moves out of an inner body may then move out of the enclosing one; no graph is
    visited after the node owning it was rewritten away). A node a rewrite moved out of the
    graph being walked is skipped."""
    for graph in reversed(u.all_graphs(model)):
        for node in u.nodes_in_order(graph):
            if node.graph is graph and u.is_op(node, *ops):
                yield graph, node


class LoopRulePass(RulePass):
    """A pass whose rules each rewrite one Loop or Scan node: each node of the op type a rule
    names first is tried with it, innermost graphs first (:func:`loops_innermost_first`)."""

    def apply(self, model: ir.Model) -> bool:
        self.run_namer = None
        by_op = {rule.ops[0]: rule for rule in self.rules}
        changed = False
        for graph, node in loops_innermost_first(model, *by_op):
            changed |= self.try_rule(by_op[node.op_type], node, RuleContext(model, graph, self))
        return changed


def body_of(node: ir.Node) -> ir.Graph | None:
    """The ``body`` subgraph of a Loop or Scan."""
    attr = node.attributes.get("body")
    if attr is None or attr.type != ir.AttributeType.GRAPH:
        return None
    return attr.as_graph()


def is_true(value: ir.Value | None) -> bool:
    arr = u.const_array(value)
    return arr is not None and arr.size == 1 and bool(arr.reshape(-1)[0])


def nested_graphs(node: ir.Node) -> list[ir.Graph]:
    """Every subgraph of ``node``, at any depth."""
    out: list[ir.Graph] = []
    pending = u.subgraphs_of(node)
    while pending:
        graph = pending.pop()
        out.append(graph)
        for inner in graph:
            pending.extend(u.subgraphs_of(inner))
    return out


def trip_count(loop: ir.Node, body: ir.Graph) -> int | None:
    """``M`` of a Loop that runs exactly its constant trip count ``M`` times, else ``None``."""
    if not loop.inputs or len(loop.inputs) < 2:
        return None
    trip = u.const_ints(loop.inputs[0])
    if trip is None or len(trip) != 1:
        return None
    if loop.inputs[1] is not None and not is_true(loop.inputs[1]):
        return None
    carried = len(loop.inputs) - 2
    if any(v is None for v in loop.inputs[2:]):
        return None
    if len(body.inputs) != 2 + carried or len(body.outputs) < 1 + carried:
        return None
    if len(loop.outputs) != len(body.outputs) - 1:
        return None
    # the body's condition output: its condition input passed through, or a constant true
    cond_out: ir.Value | None = body.outputs[0]
    while cond_out is not None and cond_out is not body.inputs[1] and not is_true(cond_out):
        producer = cond_out.producer()
        if producer is None or producer.graph is not body or not u.is_op(producer, "Identity"):
            return None
        cond_out = producer.inputs[0]
    if cond_out is None:
        return None
    return trip[0]


def typed_like(target: ir.Value, source: ir.Value) -> None:
    if target.type is None and source.type is not None:
        target.type = source.type
    if target.shape is None and source.shape is not None:
        target.shape = source.shape.copy()
