"""Concat and Where rules of ``algebraic``: a Concat of a Concat on the same axis is one Concat;
a Where of 1-D values under a known condition is the entries it picks."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import (
    RuleContext,
    replace_output,
    replace_with_node,
    reroute_refusal,
)


def _concat_axis(node: ir.Node) -> int | None:
    axis = node.attributes.get_int("axis", 0)
    if axis >= 0:
        return axis
    r = u.rank(node.outputs[0])
    return None if r is None else axis + r


def concat_of_concat(node: ir.Node, ctx: RuleContext) -> list[ir.Value] | str:
    """Check: an input is a Concat on the same axis all of whose readers are such Concats (it
    goes dead once they all read its inputs); the match is the flattened input list."""
    axis = _concat_axis(node)
    if axis is None:
        return "the axis is negative and the rank unknown"
    flat: list[ir.Value] = []
    merged = False
    for value in node.inputs:
        inner = value.producer() if value is not None else None
        if (
            value is not None
            and inner is not None
            and u.is_op(inner, "Concat")
            and _concat_axis(inner) == axis
            and not value.is_graph_output()
            and all(
                u.is_op(user, "Concat") and _concat_axis(user) == axis for user, _ in value.uses()
            )
            and all(v is not None for v in inner.inputs)
        ):
            flat.extend(v for v in inner.inputs if v is not None)
            merged = True
        elif value is None:
            return "an input is missing"
        else:
            flat.append(value)
    return flat if merged else "no input is a Concat on the same axis read by Concats only"


def flatten_concat(node: ir.Node, flat: list[ir.Value], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    merged = ir.Node(
        "",
        "Concat",
        flat,
        [ir.AttrInt64("axis", node.attributes.get_int("axis", 0))],
        name=names(f"{node.name or 'Concat'}_flat"),
    )
    replace_with_node(node, merged, names(f"{node.outputs[0].name or 'concat'}_flat"), ctx)


_Source = tuple[ir.Value, int] | np.generic  # an element of a piece, or a constant element


def _element_sources(value: ir.Value | None, n: int) -> list[_Source] | None:
    """The 1-D ``value`` broadcast to ``n`` entries, entry by entry: a constant element, or
    ``(piece, k)`` for element ``k`` of a computed 1-D piece of static length (``value`` itself,
    or an input of the Concat on axis 0 that produces it)."""
    if value is None or u.rank(value) not in (0, 1):
        return None
    const = u.const_array(value)
    if const is not None:
        flat = const.reshape(-1)
        if flat.size not in (1, n):
            return None
        return [flat[0 if flat.size == 1 else i] for i in range(n)]
    node = value.producer()
    if u.rank(value) != 1:
        return None
    pieces = (
        list(node.inputs)
        if node is not None
        and u.is_op(node, "Concat")
        and node.attributes.get_int("axis", 0) in (0, -1)
        else [value]
    )
    out: list[_Source] = []
    for piece in pieces:
        if piece is None or u.rank(piece) != 1:
            return None
        c = u.const_array(piece)
        if c is not None:
            out.extend(c.reshape(-1))
            continue
        shape = u.static_shape(piece)
        if shape is None:
            return None
        out.extend((piece, k) for k in range(shape[0]))
    if len(out) == 1 and n > 1:
        out = out * n
    return out if len(out) == n else None


# the output of a Where in order: computed pieces and constant runs
_Selection = list[ir.Value | np.ndarray]


def where_select(node: ir.Node, ctx: RuleContext) -> _Selection | str:
    """Check: ``Where(c, a, b)`` with a constant condition over 1-D values, where each entry
    the condition picks is a constant or an element of a computed piece (a Concat input, or the
    side itself) and the computed pieces are picked whole and in order; the match is the output
    as a list of pieces. Made only where a node goes: the output is one computed piece, or a
    Concat of a side is read by this Where alone (the new Concat replaces it)."""
    cond = u.const_array(node.inputs[0]) if len(node.inputs) == 3 else None
    if cond is None or cond.dtype != np.bool_ or cond.ndim > 1:
        return "the condition is not a constant boolean vector"
    shape = u.static_shape(node.outputs[0])
    if shape is None or len(shape) != 1:
        return "the output is not a 1-D value of static length"
    n = shape[0]
    if cond.size not in (1, n):
        return "the condition does not broadcast to the output's length"
    flags = np.broadcast_to(cond.reshape(-1), (n,)).tolist()
    a, b = _element_sources(node.inputs[1], n), _element_sources(node.inputs[2], n)
    if a is None or b is None:
        return "a side is not a 1-D constant, Concat or value of static length"
    picked = [x if f else y for f, x, y in zip(flags, a, b, strict=True)]
    dtype = np.dtype(node.outputs[0].dtype.numpy()) if node.outputs[0].dtype else None
    if dtype is None:
        return "the output's type is unknown"
    pieces: _Selection = []
    run: list[np.generic] = []
    i = 0
    while i < n:
        src = picked[i]
        if not isinstance(src, tuple):
            run.append(src)
            i += 1
            continue
        piece, k = src
        length = u.static_shape(piece)[0]  # type: ignore[index]
        whole = k == 0 and i + length <= n
        for j in range(1, length if whole else 0):
            nxt = picked[i + j]
            whole = whole and isinstance(nxt, tuple) and nxt[0] is piece and nxt[1] == j
        if not whole:
            return "a computed piece is not picked whole and in order"
        if run:
            pieces.append(np.array(run, dtype=dtype))
            run = []
        pieces.append(piece)
        i += length
    if run:
        pieces.append(np.array(run, dtype=dtype))
    if all(isinstance(p, np.ndarray) for p in pieces):
        return "every entry is constant (constant folding's case)"
    if len(pieces) == 1:
        refusal = reroute_refusal(node.outputs[0], pieces[0])  # type: ignore[arg-type]
        return refusal or pieces
    freed = {
        id(side.producer())
        for side in node.inputs[1:]
        if side is not None
        and u.is_op(side.producer(), "Concat")
        and not side.is_graph_output()
        and all(user is node for user, _ in side.uses())
    }
    if not freed:
        return "no Concat of a side goes dead, so the new Concat would replace only the Where"
    return pieces


def write_selection(node: ir.Node, pieces: _Selection, ctx: RuleContext) -> None:
    if len(pieces) == 1:
        replace_output(node, pieces[0], ctx)  # type: ignore[arg-type]
        return
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    inputs = [
        u.add_initializer(ctx.graph, p, names("selected")) if isinstance(p, np.ndarray) else p
        for p in pieces
    ]
    concat = ir.Node(
        "", "Concat", inputs, [ir.AttrInt64("axis", 0)], name=names(f"{node.name or 'Where'}_cat")
    )
    ctx.graph.insert_before(node, concat)
    out = concat.outputs[0]
    out.name = names(f"{node.outputs[0].name or 'selected'}_cat")
    out.type = node.outputs[0].type
    out.shape = node.outputs[0].shape
    replace_output(node, out, ctx)
