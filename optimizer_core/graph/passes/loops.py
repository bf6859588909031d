"""Loops: unrolling short ``Loop``s, hoisting loop-invariant nodes, fusing sibling ``Loop``s.

Every rewrite here is exact: it changes where and how often a computation is scheduled, never
the arithmetic of a node, so each output is computed by the same ops on the same operands.

``loop-unroll``
    A ``Loop`` that runs a constant ``M`` times (``1 <= M <= max_unroll_trip_count``) and never
    exits early (its condition input is absent or constant true, and its body returns its
    condition input unchanged or a constant true) is replaced by ``M`` copies of its body in the
    enclosing graph. Copy ``i`` reads the constant ``i`` as iteration number, true as
    condition and the loop-carried values produced by copy ``i - 1`` (the Loop's initial
    values for copy 0); the last copy's carried values replace the Loop's carried outputs, and
    each scan output becomes ``Concat(axis 0)`` of the per-iteration values, each
    ``Unsqueeze``-d on axis 0, which is how a Loop stacks them. Body values read from outer
    scopes are read from there by every copy. The body's size times ``M`` (nested subgraphs
    counted) is capped by ``max_unroll_nodes``; bodies with a nondeterministic op are not
    unrolled (the copies of a seeded random op would all draw the same numbers).

``loop-hoist``
    A node of a ``Loop`` or ``Scan`` body that is deterministic, standard-domain, without
    subgraphs and whose operands are all defined outside the body (outer-scope values, body
    constants, or outputs of other such nodes) computes the same value in every iteration: it
    moves in front of the Loop/Scan and the body reads its result as an outer-scope value. The
    body's own inputs (iteration number, condition, carried and scan values) are never such
    operands. ONNX ops are pure, so computing the value once even when the loop runs zero
    times changes no output. A hoisted value that is also a body output is returned through an
    ``Identity`` (a subgraph output must be defined in the subgraph); ``Identity`` nodes and
    nodes reading only constants are hoisted only to serve a hoisted node (folding takes care
    of constants, and an ``Identity`` returning an outer value is the one form a body output
    of an outer value may take).

``loop-fuse``
    Two ``Loop``s of the same graph, the second being the next Loop after the first, with the
    same constant trip count and no early exit (as for unrolling), where nothing the second
    reads (its inputs and the outer-scope values its body reads) depends on the first, become
    one ``Loop`` whose body runs the first body then the second in each iteration. Carried
    values and scan outputs are concatenated in order (first loop's, then second's). The two
    bodies share no values, so each computes exactly what it computed alone; nodes between the
    Loops that read the first Loop's results move after the fused Loop.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnx_ir import _cloner

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass

# ---------------------------------------------------------------- shared helpers


def _body(node: ir.Node) -> ir.Graph | None:
    attr = node.attributes.get("body")
    if attr is None or attr.type != ir.AttributeType.GRAPH:
        return None
    return attr.as_graph()


def _is_true(value: ir.Value | None) -> bool:
    arr = u.const_array(value)
    return arr is not None and arr.size == 1 and bool(arr.reshape(-1)[0])


def _nested_graphs(node: ir.Node) -> list[ir.Graph]:
    """Every subgraph of ``node``, at any depth."""
    out: list[ir.Graph] = []
    pending = u.subgraphs_of(node)
    while pending:
        graph = pending.pop()
        out.append(graph)
        for inner in graph:
            pending.extend(u.subgraphs_of(inner))
    return out


def _node_count(graph: ir.Graph) -> int:
    """Nodes of ``graph`` and of its subgraphs at any depth."""
    return sum(1 + sum(len(g) for g in _nested_graphs(n)) for n in graph)


def _reads(node: ir.Node) -> set[ir.Value]:
    """The values ``node`` reads: its inputs and the outer-scope values its subgraphs read."""
    reads = {v for v in node.inputs if v is not None}
    nested = _nested_graphs(node)
    if nested:
        inside = set(nested)
        for graph in nested:
            for inner in graph:
                reads.update(v for v in inner.inputs if v is not None and v.graph not in inside)
    return reads


def _has_nondeterministic(graph: ir.Graph) -> bool:
    for node in graph:
        if node.op_type in u.NONDETERMINISTIC_OPS:
            return True
        if any(_has_nondeterministic(g) for g in u.subgraphs_of(node)):
            return True
    return False


def _trip_count(loop: ir.Node, body: ir.Graph) -> int | None:
    """``M`` of a Loop that runs exactly its constant trip count ``M`` times, else ``None``."""
    if not loop.inputs or len(loop.inputs) < 2:
        return None
    trip = u.const_ints(loop.inputs[0])
    if trip is None or len(trip) != 1:
        return None
    if loop.inputs[1] is not None and not _is_true(loop.inputs[1]):
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
    while cond_out is not None and cond_out is not body.inputs[1] and not _is_true(cond_out):
        producer = cond_out.producer()
        if producer is None or producer.graph is not body or not u.is_op(producer, "Identity"):
            return None
        cond_out = producer.inputs[0]
    if cond_out is None:
        return None
    return trip[0]


def _output_slot(value: ir.Value, graph: ir.Graph, seen: set[ir.Value]) -> bool:
    """``value`` may be listed (once more) as an output of ``graph``."""
    if value in seen:
        return False
    if value.is_graph_input() or value.is_initializer():
        return value.graph is graph
    producer = value.producer()
    return producer is not None and producer.graph is graph and not value.is_graph_output()


def _lookup(value: ir.Value, value_map: dict[ir.Value, ir.Value | None]) -> ir.Value:
    """What ``value`` of a body stands for in one unrolled copy (itself when defined outside)."""
    mapped = value_map.get(value, value)
    assert mapped is not None
    return mapped


def _typed_like(target: ir.Value, source: ir.Value) -> None:
    if target.type is None and source.type is not None:
        target.type = source.type
    if target.shape is None and source.shape is not None:
        target.shape = source.shape.copy()


def _replace_output(graph: ir.Graph, before: ir.Node, old: ir.Value, new: ir.Value) -> None:
    """Make the readers of ``old`` (an output of ``before``) read ``new``, through an
    ``Identity`` when ``new`` cannot take over the graph output ``old`` is."""
    if not u.replace_value(old, new):
        ident = ir.node("Identity", [new])
        ident.outputs[0].name = f"{old.name}__copy"
        _typed_like(ident.outputs[0], old)
        graph.insert_before(before, ident)
        u.replace_value(old, ident.outputs[0])


# ---------------------------------------------------------------- unrolling


class LoopUnrolling(GraphtrimPass):
    name = "loop-unroll"
    summary = "unroll a Loop with a small constant trip count that never exits early"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        # innermost graphs first: no graph is visited after the Loop owning it was unrolled
        # away, and an outer Loop is measured with its inner Loops already unrolled
        for graph in reversed(u.all_graphs(model)):
            for node in u.nodes_in_order(graph):
                if node.graph is not graph or not u.is_op(node, "Loop"):
                    continue
                body = _body(node)
                if body is None:
                    continue
                trip = _trip_count(node, body)
                if trip is None or not 1 <= trip <= self.options.max_unroll_trip_count:
                    continue
                if _node_count(body) * trip > self.options.max_unroll_nodes:
                    continue
                carried = len(node.inputs) - 2
                scans = body.outputs[1 + carried :]
                if not all(u.is_tensor_value(v) for v in scans):
                    continue
                if _has_nondeterministic(body):
                    continue
                if namer is None:
                    namer = u.NameGenerator(model)
                self._unroll(model, graph, node, body, trip, namer)
                self.hit("loop-unroll")
                changed = True
        return changed

    def _unroll(
        self,
        model: ir.Model,
        graph: ir.Graph,
        loop: ir.Node,
        body: ir.Graph,
        trip: int,
        namer: u.NameGenerator,
    ) -> None:
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
            _typed_like(result, old)
            _replace_output(graph, loop, old, result)
        u.remove_nodes(graph, [loop])


# ---------------------------------------------------------------- hoisting


class LoopInvariantHoisting(GraphtrimPass):
    name = "loop-hoist"
    summary = "move loop-invariant nodes of Loop and Scan bodies in front of the loop"

    def apply(self, model: ir.Model) -> bool:
        changed = False
        namer: u.NameGenerator | None = None
        # innermost first: what leaves an inner body may then leave the enclosing one
        for graph in reversed(u.all_graphs(model)):
            for node in u.nodes_in_order(graph):
                if node.graph is not graph or not u.is_op(node, "Loop", "Scan"):
                    continue
                body = _body(node)
                if body is None:
                    continue
                hoisted = self._invariant_nodes(body)
                if not hoisted:
                    continue
                if namer is None:
                    namer = u.NameGenerator(model)
                self._hoist(graph, node, body, hoisted, namer)
                self.hit(f"{node.op_type.lower()}-hoist", len(hoisted))
                changed = True
        return changed

    @staticmethod
    def _movable_constant(value: ir.Value, body: ir.Graph) -> bool:
        return (
            value.graph is body
            and value.is_initializer()
            and not value.is_graph_input()
            and not value.is_graph_output()
        )

    def _invariant_nodes(self, body: ir.Graph) -> list[ir.Node]:
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
                elif not self._movable_constant(v, body):
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
            if node in seeds or any(
                user in chosen for out in node.outputs for user, _ in out.uses()
            ):
                chosen.add(node)
        return [n for n in invariant if n in chosen]

    def _hoist(
        self,
        graph: ir.Graph,
        loop: ir.Node,
        body: ir.Graph,
        nodes: list[ir.Node],
        namer: u.NameGenerator,
    ) -> None:
        # a body output must be defined in the body: hoisted values it returns go through an
        # Identity that stays
        produced = {out for n in nodes for out in n.outputs}
        for index, value in enumerate(list(body.outputs)):
            if value in produced:
                ident = ir.node("Identity", [value])
                out = ident.outputs[0]
                out.name = namer(f"{value.name or 'out'}_body")
                _typed_like(out, value)
                body.outputs[index] = out
                body.append(ident)
        for node in nodes:
            for v in node.inputs:
                if v is not None and v.name and self._movable_constant(v, body):
                    body.initializers.pop(v.name)
                    v.name = namer(v.name)
                    graph.register_initializer(v)
        body.remove(nodes)
        for node in nodes:
            for out in node.outputs:
                out.name = namer(out.name or "hoisted")
        graph.insert_before(loop, nodes)


# ---------------------------------------------------------------- fusion


class LoopFusion(GraphtrimPass):
    name = "loop-fuse"
    summary = "fuse two independent Loops with the same constant trip count into one"

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
        bodies = [_body(first), _body(second)]
        trips = [
            _trip_count(loop, b) if b is not None else None
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
        body1, body2 = _body(first), _body(second)
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
            self._rename(node, namer)
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
                _typed_like(ident.outputs[0], value)
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
            _typed_like(new, old)
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

    @staticmethod
    def _rename(node: ir.Node, namer: u.NameGenerator) -> None:
        for out in node.outputs:
            out.name = namer(out.name or "v")
        for sub in _nested_graphs(node):
            for value in sub.inputs:
                value.name = namer(value.name or "v")
            for name, init in list(sub.initializers.items()):
                init.name = namer(name)
            for inner in sub:
                for out in inner.outputs:
                    out.name = namer(out.name or "v")
