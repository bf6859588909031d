"""Unrolling short ``Loop``s (exact: the same ops on the same operands, scheduled differently).

A ``Loop`` that runs a constant ``M`` times (``1 <= M <= max_unroll_trip_count``) and never exits
early (its condition input is absent or constant true, and its body returns its condition input
unchanged or a constant true) is replaced by ``M`` copies of its body in the enclosing graph.
Copy ``i`` reads the constant ``i`` as iteration number, true as condition and the loop-carried
values produced by copy ``i - 1`` (the Loop's initial values for copy 0); the last copy's carried
values replace the Loop's carried outputs, and each scan output becomes ``Concat(axis 0)`` of the
per-iteration values, each ``Unsqueeze``-d on axis 0, which is how a Loop stacks them. Body values
read from outer scopes are read from there by every copy. The body's size times ``M`` (nested
subgraphs counted) is capped by ``max_unroll_nodes``; bodies with a nondeterministic op are not
unrolled (the copies of a seeded random op would all draw the same numbers).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import onnx_ir as ir
from onnx_ir import _cloner

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._loops import (
    LoopRulePass,
    body_of,
    nested_graphs,
    trip_count,
    typed_like,
)
from graphtrim.graph.rules import Rule, RuleContext


def _node_count(graph: ir.Graph) -> int:
    """Nodes of ``graph`` and of its subgraphs at any depth."""
    return sum(1 + sum(len(g) for g in nested_graphs(n)) for n in graph)


def _has_nondeterministic(graph: ir.Graph) -> bool:
    for node in graph:
        if node.op_type in u.NONDETERMINISTIC_OPS:
            return True
        if any(_has_nondeterministic(g) for g in u.subgraphs_of(node)):
            return True
    return False


def _lookup(value: ir.Value, value_map: dict[ir.Value, ir.Value | None]) -> ir.Value:
    """What ``value`` of a body stands for in one unrolled copy (itself when defined outside)."""
    mapped = value_map.get(value, value)
    assert mapped is not None
    return mapped


def _replace_output(graph: ir.Graph, before: ir.Node, old: ir.Value, new: ir.Value) -> None:
    """Make the readers of ``old`` (an output of ``before``) read ``new``, through an
    ``Identity`` when ``new`` cannot take over the graph output ``old`` is."""
    if not u.replace_value(old, new):
        ident = ir.node("Identity", [new])
        ident.outputs[0].name = f"{old.name}__copy"
        typed_like(ident.outputs[0], old)
        graph.insert_before(before, ident)
        u.replace_value(old, ident.outputs[0])


def _check(loop: ir.Node, ctx: RuleContext) -> int | str:
    """The trip count of a Loop that may be unrolled, or why not."""
    body = body_of(loop)
    if body is None:
        return "no body"
    trip = trip_count(loop, body)
    if trip is None:
        return "no constant trip count, or it may exit early"
    if not 1 <= trip <= ctx.options.max_unroll_trip_count:
        return "trip count outside 1..max_unroll_trip_count"
    if _node_count(body) * trip > ctx.options.max_unroll_nodes:
        return "the unrolled body exceeds max_unroll_nodes"
    carried = len(loop.inputs) - 2
    if not all(u.is_tensor_value(v) for v in body.outputs[1 + carried :]):
        return "a scan output is not a tensor"
    if _has_nondeterministic(body):
        return "a nondeterministic op in the body"
    return trip


def _unroll(loop: ir.Node, trip: int, ctx: RuleContext) -> None:
    model, graph = ctx.model, ctx.graph
    body = body_of(loop)
    assert body is not None
    namer = cast("LoopUnrolling", ctx.pass_).names(model)
    carried = len(loop.inputs) - 2
    iter_in, cond_in, *carried_in = body.inputs
    outputs = list(body.outputs)
    carried_out = outputs[1 : 1 + carried]
    scan_out = outputs[1 + carried :]
    # a body initializer listed as a body output stays bound to the body while listed
    body.outputs.clear()
    for name, init in list(body.initializers.items()):
        body.initializers.pop(name)
        init.name = namer(name)
        graph.register_initializer(init)

    def used(value: ir.Value) -> bool:
        return bool(value.uses()) or any(v is value for v in outputs)

    true_value: ir.Value | None = None
    if used(cond_in):
        true_value = u.add_initializer(graph, np.array(True), namer("loop_cond_true"))
    body_nodes = list(body)
    current: list[ir.Value] = [v for v in loop.inputs[2:] if v is not None]
    per_iteration: list[list[ir.Value]] = [[] for _ in scan_out]
    for i in range(trip):
        value_map: dict[ir.Value, ir.Value | None] = dict(zip(carried_in, current, strict=True))
        if used(iter_in):
            value_map[iter_in] = u.add_initializer(
                graph, np.array(i, dtype=np.int64), namer(f"{iter_in.name or 'iter'}_{i}")
            )
        if true_value is not None:
            value_map[cond_in] = true_value
        cloner = _cloner.Cloner(
            attr_map={},
            value_map=value_map,
            metadata_props={},
            allow_outer_scope_values=True,
        )
        copies = [cloner.clone_node(n) for n in body_nodes]
        for copy in copies:
            if copy.name:
                copy.name = f"{copy.name}__it{i}"
            for out in copy.outputs:
                out.name = namer(f"{out.name or 'v'}_{i}")
        graph.insert_before(loop, copies)
        current = [_lookup(v, value_map) for v in carried_out]
        for k, v in enumerate(scan_out):
            per_iteration[k].append(_lookup(v, value_map))

    for old, new in zip(loop.outputs[:carried], current, strict=True):
        _replace_output(graph, loop, old, new)
    axes: ir.Value | None = None
    opset = u.opset_version(model)
    for old, values in zip(loop.outputs[carried:], per_iteration, strict=True):
        stacked: list[ir.Value] = []
        for value in values:
            if opset >= 13:
                if axes is None:
                    axes = u.add_initializer(
                        graph, np.array([0], dtype=np.int64), namer("loop_scan_axis")
                    )
                unsq = ir.node("Unsqueeze", [value, axes])
            else:
                unsq = ir.node("Unsqueeze", [value], {"axes": [0]})
            out = unsq.outputs[0]
            out.name = namer(f"{value.name or 'scan'}_stacked")
            out.type = value.type
            if value.shape is not None:
                out.shape = ir.Shape([1, *value.shape.dims])
            graph.insert_before(loop, unsq)
            stacked.append(out)
        if len(stacked) == 1:
            result = stacked[0]
        else:
            concat = ir.node("Concat", stacked, {"axis": 0})
            result = concat.outputs[0]
            result.name = namer(f"{old.name or 'scan'}_concat")
            graph.insert_before(loop, concat)
        typed_like(result, old)
        _replace_output(graph, loop, old, result)
    u.remove_nodes(graph, [loop])


RULES: tuple[Rule, ...] = (
    Rule(
        "loop-unroll",
        "Loop(M, cond, v0) with a constant 1 <= M <= max_unroll_trip_count and no early exit "
        "-> M copies of the body, copy i reading iteration i and copy i-1's carried values; "
        "scan outputs -> Concat(Unsqueeze(s_0), ..., Unsqueeze(s_M-1), axis 0); only when "
        "M * body size <= max_unroll_nodes and the body has no nondeterministic op",
        ("Loop",),
        _check,
        _unroll,
    ),
)


class LoopUnrolling(LoopRulePass):
    # innermost graphs first: no graph is visited after the Loop owning it was unrolled away,
    # and an outer Loop is measured with its inner Loops already unrolled
    name = "loop-unroll"
    summary = "unroll a Loop with a small constant trip count that never exits early"
    rules = RULES
