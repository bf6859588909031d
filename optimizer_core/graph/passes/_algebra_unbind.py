"""Unbind rules of ``algebraic``: the pieces of size 1 that Split (or Slices) and Squeeze take of a
Transposed tensor are each taken of the tensor itself and transposed on their own, one rank lower:
``Squeeze(Split(Transpose(x, p), a)[i], a) -> Transpose(Gather(x, i, p[a]), p')``."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._algebra_reshape import slice_params
from graphtrim.graph.rules import (
    RuleContext,
    replace,
)


@dataclasses.dataclass
class _Unbind:
    x: ir.Value
    axis: int  # of x, the one the pieces are taken along
    perm: list[int] | None  # of each piece after it is taken; None: the identity
    squeezes: list[tuple[int, ir.Node]]  # (piece index, the Squeeze reading that piece)


def _transposed(t_out: ir.Value | None) -> tuple[ir.Value, list[int]] | str:
    """The input and the permutation of the Transpose producing ``t_out``."""
    t = t_out.producer() if t_out is not None else None
    if t_out is None or t is None or not u.is_op(t, "Transpose") or t.inputs[0] is None:
        return "the input is not a Transpose's result"
    x = t.inputs[0]
    r = u.rank(t_out)
    if r is None:
        r = u.rank(x)
    p = u.perm_of(t, r)
    if p is None:
        return "the permutation is invalid, or the default one of unknown rank"
    return x, p


def _squeeze_of(piece: ir.Value, axis: int, rank: int, ctx: RuleContext) -> ir.Node | str | None:
    """The Squeeze that alone reads ``piece`` and removes exactly ``axis``; ``None`` when
    nothing reads the piece."""
    if piece.is_graph_output():
        return "a piece is a graph output"
    uses = list(piece.uses())
    if not uses:
        return None
    sq = uses[0][0]
    if len(uses) != 1 or not u.is_op(sq, "Squeeze"):
        return "a piece is not read by one Squeeze alone"
    sq_axes = (
        sq.attributes.get_ints("axes", None)
        if u.node_opset(sq, ctx.model) < 13
        else (u.const_ints(sq.inputs[1]) if len(sq.inputs) > 1 else None)
    )
    if sq_axes is None or u.normalize_axes(list(sq_axes), rank) != [axis]:
        return "a Squeeze removes other axes than the split one (or reads them at run time)"
    return sq


def _unbind(x: ir.Value, p: list[int], a: int, squeezes: list[tuple[int, ir.Node]]) -> _Unbind:
    ax = p[a]
    rest = [q - (q > ax) for j, q in enumerate(p) if j != a]
    return _Unbind(x, ax, None if rest == sorted(rest) else rest, squeezes)


def unbind_of_transpose(node: ir.Node, ctx: RuleContext) -> _Unbind | str:
    """Check: ``Split(Transpose(x, p), axis=a)`` into pieces proved of size 1, each piece read
    only by a ``Squeeze`` of axis ``a`` (an unbind, as torch's TorchScript exporter writes
    ``qkv.permute(..).unbind(0)``), the Transpose read by the Split alone. The match is ``x``,
    the axis of ``x`` the pieces come from, and what is left of ``p`` once that axis is gone."""
    t_out = node.inputs[0]
    t = _transposed(t_out)
    if isinstance(t, str):
        return t
    x, p = t
    if t_out is None or not u.single_consumer(t_out):
        return "the Transpose's result is read elsewhere too"
    r = len(p)
    axes = u.normalize_axes([node.attributes.get_int("axis", 0)], r)
    if axes is None:
        return "the axis is out of range"
    a, n = axes[0], len(node.outputs)
    if u.node_opset(node, ctx.model) < 13:
        split = node.attributes.get_ints("split", None)
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        split = u.const_ints(node.inputs[1])
        if split is None:
            return "the split sizes are computed"
    else:
        split = None
    x_dims = u.dims(x)
    if split is not None:
        if list(split) != [1] * n:
            return "a piece is not of size 1"
    elif x_dims is None or x_dims[p[a]] != n:
        return f"the pieces are not proved of size 1 (the axis's size is not {n})"
    squeezes: list[tuple[int, ir.Node]] = []
    for i, piece in enumerate(node.outputs):
        sq = _squeeze_of(piece, a, r, ctx)
        if isinstance(sq, str):
            return sq
        if sq is not None:
            squeezes.append((i, sq))
    if not squeezes:
        return "no piece is read"
    return _unbind(x, p, a, squeezes)


def sliced_unbind_of_transpose(node: ir.Node, ctx: RuleContext) -> _Unbind | str:
    """Check: the same unbind spelled with Slices (torch's dynamo exporter): a Transpose whose
    every reader is a ``Slice`` of one element along one axis ``a`` (constant ``[i, i + 1)``,
    step 1), each read only by a ``Squeeze`` of axis ``a``."""
    t_out = node.outputs[0]
    if t_out.is_graph_output() or not t_out.uses():
        return "the Transpose's result is a graph output or unread"
    t = _transposed(t_out)
    if isinstance(t, str):
        return t
    x, p = t
    r = len(p)
    a: int | None = None
    squeezes: list[tuple[int, ir.Node]] = []
    for user, index in t_out.uses():
        if not u.is_op(user, "Slice") or index != 0 or u.node_opset(user, ctx.model) < 10:
            return "the Transpose's result is read elsewhere than as the data of Slices"
        params = slice_params(user, r)
        if params is None:
            return "a Slice's parameters are not constant"
        starts, ends, axes, steps = params
        if len(axes) != 1 or steps != [1] or starts[0] < 0 or ends[0] != starts[0] + 1:
            return "a Slice takes other than one element [i, i + 1) along one axis"
        if a is not None and axes[0] != a:
            return "the Slices cut different axes"
        a = axes[0]
        sq = _squeeze_of(user.outputs[0], a, r, ctx)
        if isinstance(sq, str):
            return sq
        if sq is not None:
            squeezes.append((starts[0], sq))
    if a is None or not squeezes:
        return "no piece is read"
    return _unbind(x, p, a, squeezes)


def unbind_before_transpose(node: ir.Node, m: _Unbind, ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    for i, sq in m.squeezes:
        index = u.add_initializer(ctx.graph, np.array(i, dtype=np.int64), names("unbind_index"))
        gather = ir.Node(
            "",
            "Gather",
            [m.x, index],
            [ir.AttrInt64("axis", m.axis)],
            name=names(f"{sq.name or 'Squeeze'}_gather"),
        )
        ctx.graph.insert_before(sq, gather)
        out = gather.outputs[0]
        out.type = sq.outputs[0].type
        if m.perm is None:
            out.name = names(f"{sq.outputs[0].name or 'piece'}_taken")
            out.shape = sq.outputs[0].shape
            replace(sq.outputs[0], out, f"Squeeze node '{sq.name}'")
            continue
        out.name = names(f"{sq.outputs[0].name or 'piece'}_untransposed")
        transpose = ir.Node(
            "",
            "Transpose",
            [out],
            [ir.AttrInt64s("perm", m.perm)],
            name=names(f"{sq.name or 'Squeeze'}_transpose"),
        )
        ctx.graph.insert_before(sq, transpose)
        transpose.outputs[0].name = names(f"{sq.outputs[0].name or 'piece'}_transposed")
        transpose.outputs[0].type = sq.outputs[0].type
        transpose.outputs[0].shape = sq.outputs[0].shape
        replace(sq.outputs[0], transpose.outputs[0], f"Squeeze node '{sq.name}'")
