"""Reshape, Unsqueeze and Slice rules of ``algebraic``: a Reshape of a Reshape (or of another op
that keeps the element order) is one Reshape when its target copies no dim; two Unsqueezes are
one; two Slices of disjoint axes are one; a Reshape's copied dims become static sizes where known."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import (
    RuleContext,
    replace_with_node,
)


def after_reshape(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
    """Check: ``Unsqueeze`` / ``Squeeze`` of a Reshape to a constant shape that copies no dim,
    the Reshape's result read here alone; the match is the Reshape's input and the one shape
    that does both (1s inserted at the axes, or the entries at the axes, each 1, dropped)."""
    y = node.inputs[0]
    reshape = y.producer() if y is not None else None
    if y is None or reshape is None or not u.is_op(reshape, "Reshape") or not u.single_consumer(y):
        return "the input is not a Reshape's result read here alone"
    if u.node_opset(node, ctx.model) < 13 or len(node.inputs) < 2 or len(reshape.inputs) < 2:
        return "axes are attributes (opset < 13), or no axes"
    x, shape, a = reshape.inputs[0], u.const_ints(reshape.inputs[1]), u.const_ints(node.inputs[1])
    if x is None or shape is None or a is None:
        return "the shape or the axes are not constant"
    if 0 in shape and not reshape.attributes.get_int("allowzero", 0):
        return "the shape copies a dim (0 entry)"
    if node.op_type == "Unsqueeze":
        axes = u.normalize_axes(a, len(shape) + len(a))
        if axes is None or len(set(axes)) != len(axes):
            return "axes out of range"
        rest = iter(shape)
        return x, [1 if t in axes else next(rest) for t in range(len(shape) + len(a))]
    axes = u.normalize_axes(a, len(shape))
    if axes is None or any(shape[t] != 1 for t in axes):
        return "axes out of range, or an entry at them that is not 1"
    return x, [t for i, t in enumerate(shape) if i not in set(axes)]


def one_reshape(node: ir.Node, m: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
    x, shape = m
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    reshape = node.inputs[0].producer()  # type: ignore[union-attr]
    assert reshape is not None
    target = u.add_initializer(ctx.graph, np.array(shape, dtype=np.int64), names("shape"))
    merged = ir.Node(
        "",
        "Reshape",
        [x, target],
        [ir.AttrInt64("allowzero", reshape.attributes.get_int("allowzero", 0))]
        if "allowzero" in reshape.attributes
        else [],
        name=names(f"{node.name or 'Reshape'}_merged"),
    )
    replace_with_node(node, merged, names(f"{node.outputs[0].name or 'reshaped'}_merged"), ctx)


def slice_params(node: ir.Node, rank: int) -> list[list[int]] | None:
    """``[starts, ends, axes, steps]`` of a Slice with constant parameters (opset 10+), axes
    made non-negative; ``None`` when one is not constant."""
    if len(node.inputs) < 3:
        return None
    starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes_v = node.inputs[3] if len(node.inputs) > 3 else None
    steps_v = node.inputs[4] if len(node.inputs) > 4 else None
    axes = u.const_ints(axes_v) if axes_v is not None else list(range(len(starts)))
    steps = u.const_ints(steps_v) if steps_v is not None else [1] * len(starts)
    if axes is None or steps is None or len(axes) != len(starts) or len(steps) != len(starts):
        return None
    norm = u.normalize_axes(axes, rank)
    return None if norm is None else [starts, ends, norm, steps]


def slice_pair(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[list[int]]] | str:
    """Check: ``Slice(Slice(x, ...), ...)`` on other axes, both with constant parameters, the
    inner result read by such Slices alone (each merges, then the inner one is dead: the
    strided quarters of a patch merging read x directly); the match is ``x`` and the merged
    parameters."""
    y = node.inputs[0]
    inner = y.producer() if y is not None else None
    if y is None or inner is None or not u.is_op(inner, "Slice") or y.is_graph_output():
        return "the input is not a Slice's result"
    if u.node_opset(node, ctx.model) < 10 or inner.inputs[0] is None:
        return "parameters are attributes (opset < 10)"
    rank = u.rank(y)
    if rank is None:
        return "the rank is unknown"
    inner_p = slice_params(inner, rank)
    if inner_p is None:
        return "parameters not constant or axes out of range"
    merged = None
    for user, index in y.uses():
        outer_p = slice_params(user, rank) if u.is_op(user, "Slice") and index == 0 else None
        if outer_p is None:
            return "the inner result is read elsewhere than as the data of Slices with constant parameters"
        if set(outer_p[2]) & set(inner_p[2]) or len(set(outer_p[2])) != len(outer_p[2]):
            return "the Slices share an axis"
        if user is node:
            merged = [a + b for a, b in zip(inner_p, outer_p, strict=True)]
    assert merged is not None
    return inner.inputs[0], merged


def merge_slices(node: ir.Node, m: tuple[ir.Value, list[list[int]]], ctx: RuleContext) -> None:
    x, params = m
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    inputs = [
        u.add_initializer(ctx.graph, np.array(vals, dtype=np.int64), names(f"slice_{what}"))
        for what, vals in zip(("starts", "ends", "axes", "steps"), params, strict=True)
    ]
    node.resize_inputs(5)
    node.replace_input_with(0, x)
    for i, value in enumerate(inputs, start=1):
        node.replace_input_with(i, value)


def unsqueeze_pair(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
    """Unsqueeze(Unsqueeze(x, a), b): ``x`` and the axes of both in the final tensor."""
    x = node.inputs[0]
    inner = x.producer() if x is not None else None
    if inner is None or not u.is_op(inner, "Unsqueeze") or inner.inputs[0] is None:
        return "the input is not produced by Unsqueeze"
    if u.node_opset(node, ctx.model) < 13:
        # axes are attributes
        outer_attr = node.attributes.get_ints("axes", None)
        inner_attr = inner.attributes.get_ints("axes", None)
        outer_axes = list(outer_attr) if outer_attr is not None else None
        inner_axes = list(inner_attr) if inner_attr is not None else None
    elif len(node.inputs) < 2 or len(inner.inputs) < 2:
        return "an Unsqueeze has no axes"
    else:
        outer_axes, inner_axes = u.const_ints(node.inputs[1]), u.const_ints(inner.inputs[1])
    out_rank = u.rank(node.outputs[0])
    if outer_axes is None or inner_axes is None or out_rank is None:
        return "axes not constant or rank unknown"
    b = u.normalize_axes(outer_axes, out_rank)
    a = u.normalize_axes(inner_axes, out_rank - len(outer_axes))
    if a is None or b is None:
        return "axes out of range"
    # positions of the intermediate tensor inside the final one: those not inserted by b
    kept = [i for i in range(out_rank) if i not in set(b)]
    return inner.inputs[0], sorted(set(b) | {kept[i] for i in a})


def merge_unsqueezes(node: ir.Node, match: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
    src, combined = match
    if u.node_opset(node, ctx.model) < 13:
        node.replace_input_with(0, src)
        node.attributes["axes"] = ir.AttrInt64s("axes", combined)
        return
    namer = u.NameGenerator(ctx.model)
    axes = u.add_initializer(ctx.graph, np.array(combined, dtype=np.int64), namer("unsqueeze_axes"))
    node.replace_input_with(0, src)
    node.replace_input_with(1, axes)


def _computed_shape_of_flat(node: ir.Node, inner: ir.Node) -> ir.Value | str:
    """Check: ``Reshape(Reshape(x, [-1]), s)`` with a computed ``s`` (``Shape(y)``, as a gathered
    mask is put back into the shape of its indices). Reading x directly gives the same result
    wherever the pair runs: the element count is the same, and an entry that may be 0 at run
    time (a dim read from a tensor, which "copies" then) must be x's own dim at that position,
    so that a copy reads that very size; the flat input has a single dim, which a copy at
    position 0 reads as the element count, 0 exactly when x's dim there is."""
    from graphtrim.graph.passes._symbolic_dims import Dim, named, shape_entries

    if u.rank(node.inputs[0]) != 1:
        return "the shape is computed and the input is not flat"
    src = inner.inputs[0]
    if src is None:
        return "an input is missing"
    entries = shape_entries(node.inputs[1])
    if entries is None:
        return "the shape is computed and its entries are unknown"
    if node.attributes.get_int("allowzero", 0):
        return src  # each entry is the size it says
    dims = named(src) or []
    for j, e in enumerate(entries):
        if isinstance(e, int) and e != 0:
            continue  # a size, or the -1 the element count fixes (the same for x)
        if isinstance(e, Dim) and isinstance(e.value, int) and e.value > 0:
            continue
        if isinstance(e, Dim) and j < len(dims) and dims[j] is not None and dims[j] == e.value:
            continue  # copying x's dim there reads this very size
        return "an entry may be 0 (copy) and is not proved to be x's dim at its position"
    return src


def reshape_of(op: str) -> Callable[[ir.Node, RuleContext], Any]:
    """Check: the Reshape reads ``op``'s output and its constant shape copies no dim."""

    def check(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
        x = node.inputs[0]
        inner = x.producer() if x is not None else None
        if inner is None or not u.is_op(inner, op):
            return f"the input is not produced by {op}"
        if len(node.inputs) < 2 or inner.inputs[0] is None:
            return "an input is missing"
        shape = u.const_ints(node.inputs[1])
        if shape is None and op == "Reshape":
            return _computed_shape_of_flat(node, inner)
        if shape is None:
            return "the shape is not constant"
        if 0 in shape and not node.attributes.get_int("allowzero", 0):
            # a copied dim stays the same when the source has the very dim at that position
            mid, src = u.symbolic_dims(x), u.symbolic_dims(inner.inputs[0])
            for j, t in enumerate(shape):
                if t != 0:
                    continue
                if mid is None or src is None or j >= len(mid) or j >= len(src):
                    return "the shape copies a dim (0 entry) the source may not have"
                if mid[j] is None or mid[j] != src[j] or mid[j] == 0:
                    return "the shape copies a dim (0 entry) the source may not have"
        return inner.inputs[0]

    return check


def static_copies(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    """Check: a Reshape (allowzero 0) whose constant shape copies (0 entry) dims the input has
    static; the match is the shape with those sizes written out."""
    if node.attributes.get_int("allowzero", 0) or len(node.inputs) < 2:
        return "allowzero, or no shape"
    shape = u.const_ints(node.inputs[1])
    if shape is None or 0 not in shape:
        return "the shape is not constant or copies no dim"
    dims = u.symbolic_dims(node.inputs[0])
    if dims is None or len(dims) < len(shape):
        return "the input's rank is unknown or below the shape's length"
    out: list[int] = []
    for j, t in enumerate(shape):
        d = dims[j]
        out.append(d if t == 0 and isinstance(d, int) and d > 0 else t)
    if out == shape:
        return "every dim it copies is symbolic"
    return out


def write_copies(node: ir.Node, shape: list[int], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    target = u.add_initializer(ctx.graph, np.array(shape, dtype=np.int64), names("shape_static"))
    node.replace_input_with(1, target)
