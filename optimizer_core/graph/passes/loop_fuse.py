"""Fusing sibling ``Loop``s (exact: each body computes what it computed alone).

Two ``Loop``s of the same graph, the second being the next Loop after the first, with the same
constant trip count and no early exit (as for unrolling), where nothing the second reads (its
inputs and the outer-scope values its body reads) depends on the first, become one ``Loop``
whose body runs the first body then the second in each iteration. Carried values and scan
outputs are concatenated in order (first loop's, then second's). The two bodies share no values,
so each computes exactly what it computed alone; nodes between the Loops that read the first
Loop's results move after the fused Loop.
"""

from __future__ import annotations

import itertools

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.passes._loops import body_of, nested_graphs, trip_count, typed_like
from graphtrim.graph.rules import Rule


def _reads(node: ir.Node) -> set[ir.Value]:
    """The values ``node`` reads: its inputs and the outer-scope values its subgraphs read."""
    reads = {v for v in node.inputs if v is not None}
    nested = nested_graphs(node)
    if nested:
        inside = set(nested)
        for graph in nested:
            for inner in graph:
                reads.update(v for v in inner.inputs if v is not None and v.graph not in inside)
    return reads


def _output_slot(value: ir.Value, graph: ir.Graph, seen: set[ir.Value]) -> bool:
    """``value`` may be listed (once more) as an output of ``graph``."""
    if value in seen:
        return False
    if value.is_graph_input() or value.is_initializer():
        return value.graph is graph
    producer = value.producer()
    return producer is not None and producer.graph is graph and not value.is_graph_output()


def _rename(node: ir.Node, namer: u.NameGenerator) -> None:
    for out in node.outputs:
        out.name = namer(out.name or "v")
    for sub in nested_graphs(node):
        for value in sub.inputs:
            value.name = namer(value.name or "v")
        for name, init in list(sub.initializers.items()):
            init.name = namer(name)
        for inner in sub:
            for out in inner.outputs:
                out.name = namer(out.name or "v")


RULES: tuple[Rule, ...] = (
    Rule(
        "loop-fuse",
        "Loop_1(M, body_1) then the next Loop_2(M, body_2) in the same graph, both with the same "
        "constant M and no early exit, Loop_2 reading nothing computed from Loop_1 -> "
        "Loop(M, body_1; body_2) carrying both loops' values (first's, then second's); nodes "
        "between them that read Loop_1 move after the fused Loop",
    ),
)


class LoopFusion(GraphtrimPass):
    name = "loop-fuse"
    summary = "fuse two independent Loops with the same constant trip count into one"
    rules = RULES

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        for graph in u.all_graphs(model):
            loops = [n for n in graph if u.is_op(n, "Loop")]
            for first, second in itertools.pairwise(loops):
                if first.graph is not graph or second.graph is not graph:
                    continue  # one of them was fused already
                plan = self._plan(graph, first, second)
                if plan is None:
                    continue
                if namer is None:
                    namer = u.NameGenerator(model)
                self._fuse(graph, first, second, plan, namer)
                self.hit("loop-fuse")
                changed = True
        return changed

    def _plan(self, graph: ir.Graph, first: ir.Node, second: ir.Node) -> list[ir.Node] | None:
        """The nodes between the Loops that depend on the first (they move after the fused
        Loop), or ``None`` when the Loops cannot be fused."""
        bodies = [body_of(first), body_of(second)]
        trips = [
            trip_count(loop, b) if b is not None else None
            for loop, b in zip((first, second), bodies, strict=True)
        ]
        if trips[0] is None or trips[0] != trips[1] or trips[0] < 0:
            return None
        if any(loop.inputs[0] is None or len(loop.attributes) != 1 for loop in (first, second)):
            return None
        tainted = set(first.outputs)
        dependent: list[ir.Node] = []
        nodes = list(graph)
        for node in nodes[nodes.index(first) + 1 : nodes.index(second)]:
            if _reads(node) & tainted:
                dependent.append(node)
                tainted.update(node.outputs)
        if _reads(second) & tainted:
            return None
        return dependent

    def _fuse(
        self,
        graph: ir.Graph,
        first: ir.Node,
        second: ir.Node,
        dependent: list[ir.Node],
        namer: u.NameGenerator,
    ) -> None:
        body1, body2 = body_of(first), body_of(second)
        assert body1 is not None and body2 is not None
        n1, n2 = len(first.inputs) - 2, len(second.inputs) - 2
        outs1, outs2 = list(body1.outputs), list(body2.outputs)
        ins2 = list(body2.inputs)
        body1.outputs.clear()
        body2.outputs.clear()
        body2.inputs.clear()
        # the second body reads the first's iteration number and condition
        mapping = {ins2[0]: body1.inputs[0], ins2[1]: body1.inputs[1]}
        for old, new in mapping.items():
            old.replace_all_uses_with(new)
        outs2 = [mapping.get(v, v) for v in outs2]
        # every name of the second body is renamed: the two bodies may use the same names
        for name, init in list(body2.initializers.items()):
            body2.initializers.pop(name)
            init.name = namer(name)
            body1.register_initializer(init)
        for value in ins2[2:]:
            value.name = namer(value.name or "carried")
            body1.inputs.append(value)
        moved = list(body2)
        body2.remove(moved)
        for node in moved:
            _rename(node, namer)
        body1.extend(moved)

        ordered = [
            outs1[0],
            *outs1[1 : 1 + n1],
            *outs2[1 : 1 + n2],
            *outs1[1 + n1 :],
            *outs2[1 + n2 :],
        ]
        seen: set[ir.Value] = set()
        for value in ordered:
            if not _output_slot(value, body1, seen):
                ident = ir.node("Identity", [value])
                ident.outputs[0].name = namer(f"{value.name or 'out'}_copy")
                typed_like(ident.outputs[0], value)
                body1.append(ident)
                value = ident.outputs[0]
            seen.add(value)
            body1.outputs.append(value)

        k1 = len(first.outputs) - n1
        k2 = len(second.outputs) - n2
        fused = ir.Node(
            "",
            "Loop",
            [first.inputs[0], first.inputs[1], *first.inputs[2:], *second.inputs[2:]],
            [ir.AttrGraph("body", body1)],
            num_outputs=n1 + n2 + k1 + k2,
            name=first.name,
        )
        olds = [
            *first.outputs[:n1],
            *second.outputs[:n2],
            *first.outputs[n1:],
            *second.outputs[n2:],
        ]
        for old, new in zip(olds, fused.outputs, strict=True):
            new.name = namer(old.name or "loop_out")
            typed_like(new, old)
        graph.insert_before(second, fused)
        for old, new in zip(olds, fused.outputs, strict=True):
            u.replace_value(old, new)
        # the first Loop's body now belongs to the fused Loop: removing the first Loop must not
        # release what that body reads
        first.attributes["body"] = ir.AttrGraph("body", ir.Graph([], [], nodes=[]))
        u.remove_nodes(graph, [first, second])
        if dependent:
            graph.remove(dependent)
            graph.insert_after(fused, dependent)
