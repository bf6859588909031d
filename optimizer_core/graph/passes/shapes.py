"""Shape arithmetic over symbolic dims: computed shapes replaced by constants without freezing
the model's dynamic dims.

Exporters build a target shape from the input's own dims at run time, e.g.
``Reshape(x, Concat(Unsqueeze(Gather(Shape(y), 0)), Unsqueeze(Gather(Shape(y), 1)), [-1, 64]))``.
When the dim read from ``y`` is provably the dim ``x`` already has at that position (the same
static size or the same named symbolic dim), the entry can say so without reading it:

- ``reshape-copy-dims``: a ``Reshape`` entry that equals ``x``'s own dim at the same position
  becomes ``0`` ("copy this dim"). With ``allowzero=1`` (torch's dynamo exporter sets it) a ``0``
  means a zero-sized dim, so the rewrite also sets ``allowzero=0``; it is made only when no other
  entry is a literal ``0``: a copied dim of size 0 is 0 either way, and every other entry keeps
  its meaning. One entry nothing proves (at most one, when the shape has no ``-1`` and no
  ``0``) becomes ``-1``: the output has the input's element count, which fixes that entry given
  the others. When every entry of the computed shape is then
  known, the shape becomes a constant (``[0, 0, -1, 64]`` above) and the
  ``Shape -> Gather -> Unsqueeze -> Concat`` chain goes dead. A shape that reproduces ``x``'s
  own shape makes the Reshape a no-op, which the identity pass then removes.
- ``range-dim``: ``Range(0, d, 1)`` over a dim ``d`` read from a tensor is named after that dim
  (onnx's inference leaves it unnamed), so that values computed from it (position ids, relative
  position buckets, attention biases) carry the model's dim names and the rules here can match.
- ``fill-dims``: likewise ``ConstantOfShape(Shape(x))`` has ``x``'s dims.
- ``shape-read-origin``: ``Gather(Shape(y), i)`` reads dim ``i`` where it comes from, up the
  ops that carry it unchanged (:mod:`graphtrim.graph.passes._dim_origin`), at the furthest value
  there that already has several readers, so that reads of one dim through different values
  become one; the same chains prove Reshape and Expand entries equal to the input's own dim
  (``reshape-copy-dims`` and ``expand-keep-dims``), named or not.
- ``expand-keep-dims``: an ``Expand`` entry that equals ``x``'s own dim (right-aligned) becomes
  ``1``: broadcasting a dim to its own size and keeping it are the same.
- ``reshape-transpose-reshape``: ``Reshape(Transpose(Reshape(x, [-1, *tail]), p), [*lead, *t])``
  where the first Reshape merges ``x``'s leading dims ``lead = x[:k]`` into one (``tail`` is
  ``x[k:]``), ``p`` keeps axis 0 in place, and the second Reshape splits that axis back into
  ``lead`` (``t`` is the transposed tail) is ``Transpose(x, [0, .., k-1, k-1+p[1], ..])``: the
  merged axis is never moved, so the elements keep their order within it. Exporters write this
  for a batched matrix product over ``[batch * heads, ...]`` (torch's dynamo exporter, for the
  key transpose of attention). Every entry must be proved (a static size or a named dim); the
  only ``-1`` allowed is the merged one.

Both rewrites are exact: the computed and the constant shape give the same result for every
input the model accepts. Named symbolic dims are equal when their names are: the ONNX meaning of
a ``dim_param`` shared by values of one model, which onnx shape inference and the exporters
(torch's symbolic shapes) propagate. Anonymous dims are taken as equal only where
they come from one place (the same dim of one value, up the ops that carry it unchanged).

Computed shapes are read through ``Casts`` between int64 and int32 too: tf2onnx writes
TensorFlow's int32 shapes (``Shape -> Cast(int32) -> Slice -> Concat -> Cast(int64)``). Such a
model computes its shapes in int32, so it is defined for dims below 2**31 only; for those the
casts keep every value.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.framework import GraphtrimPass
from graphtrim.graph.passes._dim_origin import DimOrigins
from graphtrim.graph.passes._output_dims import (
    computed_shape,
    name_concat,
    name_expand,
    name_fill,
    name_range,
    name_reshape,
    name_slice,
    name_tile,
)
from graphtrim.graph.passes._symbolic_dims import (
    Dim,
    name_reshape_dims,
    named,
    proves,
    same,
    shape_entries,
    shape_span,
)
from graphtrim.graph.rules import Rule

# whole-graph rules: they run in rounds with shape inference in between (see ``apply``)
RULES: tuple[Rule, ...] = (
    Rule(
        "range-dim",
        "Range(0, d, 1) has the dim d when d is a dim read from a tensor (its output is named "
        "after it; the shapes inference derived from the unnamed dim are forgotten)",
    ),
    Rule("fill-dims", "ConstantOfShape(Shape(x)) has x's dims (entry by entry, as range-dim)"),
    Rule(
        "concat-dims",
        "Concat(x1, .., xn, axis) has the sum of the inputs' dims on the axis (named by its "
        "terms, as (past+1)) and their common dim elsewhere (named as range-dim)",
    ),
    Rule(
        "reshape-dims",
        "Reshape(x, s) has s's dims entry by entry (sizes, dims read from tensors): 0 copies "
        "x's, and -1 is x's dims over the other entries where that leaves one named dim or a "
        "static size (named as range-dim)",
    ),
    Rule(
        "slice-dims",
        "Slice(c, starts, ends, axes, steps) of a constant table c (position ids, masks) has "
        "c's dims on the axes it does not slice (its parameters may be computed; the axes "
        "constant) and, on a sliced axis, the size the constant parameters leave or c's dim "
        "for [0:INT_MAX:1]",
    ),
    Rule(
        "expand-dims",
        "Expand(x, s) has the broadcast of x's dims and s's entries (right-aligned), each "
        "decided: an entry or a dim of 1 takes the other side (named as range-dim)",
    ),
    Rule(
        "tile-dims",
        "Tile(x, r) has x's dims times the constant repeats r, dim by dim (a named dim times k "
        "is named as range-dim: (16*batch))",
    ),
    Rule(
        "reshape-transpose-reshape",
        "Reshape(Transpose(Reshape(x, [-1, *tail]), p), [*lead, *t]) -> Transpose(x, [0, .., "
        "k-1, k-1+p[1], ..]) when the first Reshape merges x's leading dims lead = x[:k], p keeps "
        "axis 0 and the second splits it back into lead, every entry proved",
    ),
    Rule(
        "reshape-copy-dims",
        "Reshape(x, computed s) -> Reshape(x, constant s) with 0 (copy) for each entry proved to "
        "be x's dim at its position (allowzero set to 0 when no other entry is a literal 0)",
    ),
    Rule(
        "shape-read-origin",
        "Shape(y) read by Gathers of constant indices -> Shape(x) with the indices of x, where "
        "each read dim of y is provably a dim of one upstream value x (see _dim_origin): equal "
        "reads through different values become one, and the read moves next to x",
    ),
    Rule(
        "expand-keep-dims",
        "Expand(x, computed s) -> Expand(x, constant s) with 1 for each entry proved to be x's "
        "dim (right-aligned): broadcasting a dim to its own size keeps it",
    ),
)


class SymbolicShapes(GraphtrimPass):
    name = "symbolic-shapes"
    exact = True
    summary = "computed Reshape/Expand shapes made constant where symbolic dims prove the entries"
    rules = RULES
    resolves_shapes = True

    # rounds of renaming and re-inference within one run (see ``apply``)
    max_rounds = 4

    def apply(self, model: ir.Model) -> bool:
        """Rewrite what the current shapes prove. Renaming dims forgets the shapes inference
        derived from them; inference then runs at once and the rules again, so that what the
        new names prove is found in this run rather than one whole fixed-point iteration later
        (each iteration runs every pass again)."""
        from graphtrim.graph.shape_inference import ShapeInference

        changed = False
        for _ in range(self.max_rounds):
            forgotten: list[ir.Value] = []
            changed |= self._apply_once(model, forgotten)
            if not forgotten:
                break
            ShapeInference().call(model)
            if all(v.shape is None for v in forgotten):
                break  # inference found none of them again: another round would not either
        return changed

    def _apply_once(self, model: ir.Model, forgotten: list[ir.Value]) -> bool:
        changed = False
        namer: u.NameGenerator | None = None

        def name(hint: str) -> str:
            # built at the first new name (a scan of the whole model), not on every round
            nonlocal namer
            namer = namer or u.NameGenerator(model)
            return namer(hint)

        origins = DimOrigins(model)
        for graph, node in u.standard_nodes(model):
            if node.op_type == "Shape":
                if self._shape_origin(node, graph, origins, name):
                    self.hit("shape-read-origin")
                    changed = True
                continue
            if node.op_type in ("Range", "ConstantOfShape"):
                named = (
                    name_range(node, forgotten)
                    if node.op_type == "Range"
                    else name_fill(node, forgotten)
                )
                if named:
                    self.hit("range-dim" if node.op_type == "Range" else "fill-dims")
                    changed = True
                continue
            if node.op_type == "Concat":
                if name_concat(node, forgotten):
                    self.hit("concat-dims")
                    changed = True
                continue
            if node.op_type == "Tile":
                if name_tile(node, forgotten):
                    self.hit("tile-dims")
                    changed = True
                continue
            if node.op_type == "Slice":
                if name_slice(node, forgotten, u.node_opset(node, model)):
                    self.hit("slice-dims")
                    changed = True
                continue
            if node.op_type == "Reshape":
                if self._reshape_transpose_reshape(node, graph):
                    self.hit("reshape-transpose-reshape")
                    changed = True
                    continue
                if name_reshape(node, forgotten):
                    self.hit("reshape-dims")
                    changed = True
                    continue
                new = self._reshape(node, origins)
                rule = "reshape-copy-dims"
            elif node.op_type == "Expand":
                new = self._expand(node, origins)
                rule = "expand-keep-dims"
                if new is None:
                    if name_expand(node, forgotten):
                        self.hit("expand-dims")
                        changed = True
                    continue
            else:
                continue
            if new is None:
                continue
            const = u.add_initializer(graph, np.array(new, dtype=np.int64), name("shape"))
            node.replace_input_with(1, const)
            if node.op_type == "Reshape":
                if node.attributes.get_int("allowzero", 0):
                    node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
                name_reshape_dims(node, new)
            self.hit(rule)
            changed = True
        return changed

    @staticmethod
    def _shape_origin(
        node: ir.Node, graph: ir.Graph, origins: DimOrigins, name: Callable[[str], str]
    ) -> bool:
        """``Shape(y)`` whose every reader is ``Gather(axis=0)`` of constant indices, and whose
        read dims can all be read from one value ``x`` up their chains (where
        :meth:`DimOrigins.read_point` puts them): the Shape reads ``x`` (no start or end) and
        each Gather x's dims; the Shape moves next to x's producer, so that x's buffer is not
        kept for a read of its dims alone. A Shape read otherwise moves only to a value of y's
        own shape (the same dims at the same positions)."""
        y = node.inputs[0] if node.inputs else None
        r = u.rank(y)
        out = node.outputs[0]
        if y is None or r is None or out.is_graph_output():
            return False
        start, end = shape_span(node, r)
        length = end - start
        readers = list(out.uses())
        if not readers:
            return False
        picks: list[tuple[ir.Node, list[int], tuple[int, ...]]] = []
        for use in readers:
            g = use.node
            idx = (
                u.const_array(g.inputs[1])
                if u.is_op(g, "Gather") and use.idx == 0 and len(g.inputs) == 2
                else None
            )
            if (
                idx is None
                or g.attributes.get_int("axis", 0) != 0
                or idx.ndim > 1
                or idx.dtype.kind != "i"
            ):
                picks = []
                break
            flat = [int(k) + length if int(k) < 0 else int(k) for k in idx.ravel()]
            if any(not 0 <= k < length for k in flat):
                return False
            picks.append((g, [start + k for k in flat], idx.shape))
        if picks:
            found = {p: origins.read_point(y, p) for _, positions, _ in picks for p in positions}
            sources = {id(x) for x, _ in found.values()}
            if len(sources) != 1:
                return False
            x = next(iter(found.values()))[0]
            if x is y and start == 0 and all(found[p][1] == p for p in found):
                return False
            for g, positions, shape in picks:
                new = np.array([found[p][1] for p in positions], dtype=np.int64).reshape(shape)
                old = u.const_array(g.inputs[1])
                if old is None or not np.array_equal(new, old):
                    g.replace_input_with(1, u.add_initializer(graph, new, name("dim_index")))
            node.replace_input_with(0, x)
            for attr in ("start", "end"):
                node.attributes.pop(attr, None)
        else:
            if r == 0:
                return False  # a scalar's shape is the empty list wherever it is read
            moved = [origins.read_point(y, p) for p in range(r)]
            x = moved[0][0]
            if x is y or u.rank(x) != r:
                return False
            if any(v is not x or j != p for p, (v, j) in enumerate(moved)):
                return False
            node.replace_input_with(0, x)
        _place_after(node, graph, x)
        return True

    def _reshape(self, node: ir.Node, origins: DimOrigins) -> list[int] | None:
        allowzero = node.attributes.get_int("allowzero", 0)
        entries = computed_shape(node)
        x_dims = named(node.inputs[0]) or []
        if entries is None:
            return None
        out: list[int] = []
        unproved: list[int] = []
        for j, e in enumerate(entries):
            if isinstance(e, int):
                out.append(e)
            elif j < len(x_dims) and (
                same(e, x_dims[j]) or origins.reads(node.inputs[1], j, node.inputs[0], j)
            ):
                out.append(0)
            elif isinstance(e, Dim) and isinstance(e.value, int) and e.value > 0:
                out.append(e.value)  # a static size (0 would mean "copy" here)
            else:
                unproved.append(j)
                out.append(-1)
        if allowzero and any(e == 0 for e in entries if isinstance(e, int)):
            return None  # a literal zero would turn into "copy" under allowzero=0
        if len(unproved) == 1 and out.count(-1) == 2:
            # the shape's own -1 stands for a size the output's dims prove (the element count
            # over the other entries, ``reshape-dims``): written out, it leaves the -1 to the
            # entry nothing proves ([4*batch, 16, -1] of [batch, 4, 16, 32] is [-1, 16, 32])
            out_dims = named(node.outputs[0])
            own = next(j for j, t in enumerate(out) if t == -1 and j not in unproved)
            size = out_dims[own] if out_dims is not None and len(out_dims) == len(out) else None
            if isinstance(size, int) and size > 0:
                out[own] = size
        if unproved and (len(unproved) > 1 or out.count(-1) > 1 or any(e == 0 for e in out)):
            # one entry nothing proves is inferred (-1): the Reshape's output has the input's
            # element count, which fixes that entry given the others, provided none is zero-sized
            return None
        return out if out.count(-1) <= 1 else None

    def _expand(self, node: ir.Node, origins: DimOrigins) -> list[int] | None:
        entries = computed_shape(node)
        x_dims = named(node.inputs[0])
        if entries is None or x_dims is None:
            return None
        out: list[int] = []
        offset = len(entries) - len(x_dims)
        for j, e in enumerate(entries):
            xj = j - offset
            if xj >= 0 and (
                same(e, x_dims[xj]) or origins.reads(node.inputs[1], j, node.inputs[0], xj)
            ):
                out.append(1)
            elif isinstance(e, int) and e >= 0:
                out.append(e)
            elif isinstance(e, Dim) and isinstance(e.value, int):
                out.append(e.value)
            else:
                return None
        return out

    @staticmethod
    def _reshape_transpose_reshape(r2: ir.Node, graph: ir.Graph) -> bool:
        t_out = r2.inputs[0]
        if t_out is None or not u.single_consumer(t_out):
            return False
        t = t_out.producer()
        if t is None or not u.is_op(t, "Transpose") or t.inputs[0] is None:
            return False
        r1_out = t.inputs[0]
        r1 = r1_out.producer()
        if r1 is None or not u.is_op(r1, "Reshape") or not u.single_consumer(r1_out):
            return False
        x = r1.inputs[0]
        xd = named(x)
        if xd is None or len(r2.inputs) < 2 or len(r1.inputs) < 2:
            return False
        e1 = shape_entries(r1.inputs[1])
        e2 = shape_entries(r2.inputs[1])
        if e1 is None or e2 is None or "perm" not in t.attributes:
            return False
        perm = u.perm_of(t, len(e1))
        if perm is None:
            return False
        k = len(xd) - len(e1) + 1
        if k < 2 or e1[0] != -1 or perm[0] != 0 or len(e2) != k + len(e1) - 1:
            return False
        tail = xd[k:]
        if not all(proves(e, d) for e, d in zip(e1[1:], tail, strict=True)):
            return False
        moved = [tail[i - 1] for i in perm[1:]]
        if not all(proves(e, d) for e, d in zip(e2, [*xd[:k], *moved], strict=True)):
            return False
        new_perm = [*range(k), *(k - 1 + i for i in perm[1:])]
        node = ir.Node("", "Transpose", [x], [ir.AttrInt64s("perm", new_perm)], name=r2.name)
        graph.insert_before(r2, node)
        node.outputs[0].shape = r2.outputs[0].shape
        node.outputs[0].type = r2.outputs[0].type
        if not u.replace_value(r2.outputs[0], node.outputs[0]):
            u.remove_nodes(graph, [node])
            return False
        u.remove_nodes(graph, [r2, t, r1])
        return True


def _place_after(node: ir.Node, graph: ir.Graph, x: ir.Value) -> None:
    """Move ``node`` (it reads ``x`` alone) right after x's producer, or to the front of its
    graph when x is an input or initializer of that graph."""
    producer = x.producer()
    if producer is not None:
        if producer.graph is not graph or node.graph is not graph:
            return
        graph.remove(node)
        graph.insert_after(producer, node)
        return
    if node.graph is not graph or x.graph is not graph:
        return
    first = next(iter(graph), None)
    if first is None or first is node:
        return
    graph.remove(node)
    graph.insert_before(first, node)
