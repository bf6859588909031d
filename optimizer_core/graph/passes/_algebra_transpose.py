"""Transpose rules of ``algebraic``: two Transposes compose (or cancel); Transposes around an
Unsqueeze move past it; a Transpose that moves only dims of size 1 is a Reshape; a Transpose, a
Reshape that only splits axes and a Transpose are a Reshape and one Transpose."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._algebra_reshape import (
    reshape_of,
)
from graphtrim.graph.rules import (
    RuleContext,
    replace_output,
    replace_with_node,
    reroute_refusal,
)


def _transpose_pair(node: ir.Node) -> tuple[ir.Value, list[int]] | str:
    """The inner Transpose's input and the composed permutation."""
    x = node.inputs[0]
    inner = x.producer() if x is not None else None
    if inner is None or not u.is_op(inner, "Transpose") or inner.inputs[0] is None:
        return "the input is not produced by Transpose"
    r = u.rank(x)
    p, q = u.perm_of(inner, r), u.perm_of(node, r)
    if p is None or q is None:
        return "a permutation that is invalid, or the default one of unknown rank"
    if len(p) != len(q):
        return "permutations of different lengths"
    return inner.inputs[0], [p[i] for i in q]


def transpose_cancel(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    pair = _transpose_pair(node)
    if isinstance(pair, str):
        return pair
    src, composed = pair
    if composed != list(range(len(composed))):
        return "the composed permutation is not the identity"
    return reroute_refusal(node.outputs[0], src) or src


def transpose_compose(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
    # also where the pair cancels but a graph input would have to become a graph output
    return _transpose_pair(node)


def compose_transposes(node: ir.Node, match: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
    src, composed = match
    node.replace_input_with(0, src)
    node.attributes["perm"] = ir.AttrInt64s("perm", composed)


@dataclasses.dataclass
class _AroundUnsqueeze:
    x: ir.Value
    axes: list[int]  # of the new Unsqueeze of x
    perm: list[int] | None  # of the Transpose after it; None: the identity (no Transpose)


def transposes_around_unsqueeze(node: ir.Node, ctx: RuleContext) -> _AroundUnsqueeze | str:
    """Check: ``Transpose(Unsqueeze(Transpose(x, p), a), q)``, each inner result read once;
    the match is ``x`` unsqueezed where the output has its unit dims, and the permutation that
    is left (``None`` when the two Transposes cancel around the Unsqueeze)."""
    z = node.inputs[0]
    unsq = z.producer() if z is not None else None
    if z is None or unsq is None or not u.is_op(unsq, "Unsqueeze") or not u.single_consumer(z):
        return "the input is not an Unsqueeze read by this Transpose alone"
    if u.node_opset(unsq, ctx.model) < 13 or len(unsq.inputs) < 2:
        return "axes are attributes (opset < 13)"
    y = unsq.inputs[0]
    inner = y.producer() if y is not None else None
    if y is None or inner is None or not u.is_op(inner, "Transpose") or not u.single_consumer(y):
        return "the Unsqueeze does not read a Transpose that it alone reads"
    x, r = inner.inputs[0], u.rank(y)
    a = u.const_ints(unsq.inputs[1])
    if x is None or r is None or a is None:
        return "the rank or the axes are unknown"
    p, q = u.perm_of(inner, r), u.perm_of(node, r + len(a))
    axes = u.normalize_axes(a, r + len(a))
    if axes is None or len(set(axes)) != len(axes) or p is None or q is None:
        return "axes out of range or permutations that are invalid for the ranks"
    # what each position of the Unsqueeze's output holds: None for a unit dim, else x's axis
    rest = iter(p)
    held: list[int | None] = [None if t in axes else int(next(rest)) for t in range(r + len(a))]
    out = [held[j] for j in q]
    new_axes = [j for j, h in enumerate(out) if h is None]
    # Unsqueeze(x, new_axes) holds x's axes in order at the other positions
    at = [j for j, h in enumerate(out) if h is not None]
    perm = list(range(len(out)))
    for j, h in zip(at, (h for h in out if h is not None), strict=True):
        perm[j] = at[h]
    if perm == list(range(len(out))):
        refusal = reroute_refusal(node.outputs[0], unsq.outputs[0])
        if refusal is not None:
            return refusal
        return _AroundUnsqueeze(x, new_axes, None)
    return _AroundUnsqueeze(x, new_axes, perm)


def unsqueeze_then_transpose(node: ir.Node, m: _AroundUnsqueeze, ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    axes = u.add_initializer(ctx.graph, np.array(m.axes, dtype=np.int64), names("unsqueeze_axes"))
    unsq = ir.Node("", "Unsqueeze", [m.x, axes], name=names(f"{node.name or 'Unsqueeze'}_moved"))
    ctx.graph.insert_before(node, unsq)
    unsq.outputs[0].name = names(f"{m.x.name or 'x'}_unsqueezed")
    unsq.outputs[0].type = node.outputs[0].type
    if m.perm is None:
        unsq.outputs[0].shape = node.outputs[0].shape
        replace_output(node, unsq.outputs[0], ctx)
        return
    node.replace_input_with(0, unsq.outputs[0])
    node.attributes["perm"] = ir.AttrInt64s("perm", m.perm)


def _unit_moves(transpose: ir.Node, dims: Sequence[int | str | None]) -> list[int] | str:
    """The permutation of ``transpose`` on an input of ``dims`` when it moves only dims of size
    1 (the others keep their relative order), else why not."""
    perm = u.perm_of(transpose, len(dims))
    if perm is None:
        return "the permutation is invalid for the rank"
    moved = [axis for axis in perm if dims[axis] != 1]
    if moved != sorted(moved):
        return "the Transpose reorders dims that may not be 1"
    return perm


def unit_transpose(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    """Check: a Transpose that moves only dims of size 1 (the others keep their order), so it
    keeps the element order; the match is a constant Reshape target for its output: static
    sizes, 0 for a symbolic dim that stays in place, at most one -1."""
    x = node.inputs[0]
    dims = u.symbolic_dims(x) if x is not None else None
    if x is None or dims is None:
        return "the rank is unknown"
    perm = _unit_moves(node, dims)
    if isinstance(perm, str):
        return perm
    symbolic = sum(1 for d in dims if not isinstance(d, int))
    target: list[int] = []
    for j, axis in enumerate(perm):
        d = dims[axis]
        if isinstance(d, int):
            target.append(d)
        elif symbolic == 1:
            target.append(-1)  # the one size the others do not fix (a Reshape chain merges)
        elif axis == j:
            target.append(0)  # a symbolic dim in place: copied
        else:
            return "two or more symbolic dims, one of them moved"
    if 0 in dims and (0 in target or -1 in target):
        return "a dim of size 0: a copied or inferred size would be ambiguous"
    if all(t != 1 and axis == j for j, (t, axis) in enumerate(zip(target, perm, strict=True))):
        return "nothing moves"
    return target


def as_reshape(node: ir.Node, target: list[int], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    shape = u.add_initializer(ctx.graph, np.array(target, dtype=np.int64), names("shape"))
    reshape = ir.Node(
        "", "Reshape", [node.inputs[0], shape], name=names(f"{node.name or 'Transpose'}_reshape")
    )
    name = names(f"{node.outputs[0].name or 'transposed'}_reshaped")
    replace_with_node(node, reshape, name, ctx)


def _split_groups(y: list[int], z: list[int]) -> list[list[int]] | None:
    """The axes of ``z`` each axis of ``y`` splits into, when ``z`` only splits ``y``'s axes
    (in order, never merging two); a unit dim may go with either neighbour (it moves no
    element), a unit axis of ``y`` may vanish."""
    groups: list[list[int]] = []
    k = 0
    for size in y:
        group: list[int] = []
        if size == 1:
            while k < len(z) and z[k] == 1:
                group.append(k)
                k += 1
        else:
            product = 1
            while k < len(z) and product < size:
                group.append(k)
                product *= z[k]
                k += 1
            if product != size:
                return None
        groups.append(group)
    if not groups:
        return None
    while k < len(z) and z[k] == 1:
        groups[-1].append(k)
        k += 1
    return groups if k == len(z) else None


def transpose_split_transpose(
    node: ir.Node, ctx: RuleContext
) -> tuple[ir.Value, list[int], list[int]] | str:
    """Check: ``Transpose(Reshape(Transpose(x, p1), s), p2)`` where the Reshape only splits
    axes (static shapes, each intermediate read once): the split moves in front of the first
    Transpose and the two permutations become one; the match is ``x``, x's shape split alike
    and the combined permutation."""
    mid = node.inputs[0]
    reshape = mid.producer() if mid is not None else None
    if mid is None or reshape is None or not u.is_op(reshape, "Reshape"):
        return "the input is not a Reshape's result"
    t_out = reshape.inputs[0]
    first = t_out.producer() if t_out is not None else None
    if t_out is None or first is None or not u.is_op(first, "Transpose"):
        return "the Reshape's input is not a Transpose's result"
    if not u.single_consumer(mid) or not u.single_consumer(t_out) or mid.is_graph_output():
        return "an intermediate result is read elsewhere"
    x = first.inputs[0]
    if x is None:
        return "the Transpose has no input"
    xs, ys, zs = u.static_shape(x), u.static_shape(t_out), u.static_shape(mid)
    if xs is None or ys is None or zs is None or 0 in xs or 0 in zs:
        return "the shapes are not static (or hold a zero)"
    r = len(xs)
    p1, p2 = u.perm_of(first, r), u.perm_of(node, len(zs))
    if p1 is None or p2 is None:
        return "a permutation is invalid"
    groups = _split_groups(list(ys), list(zs))
    if groups is None:
        return "the Reshape does not only split axes"
    # x split alike, in x's own axis order: x's axis p1[i] is y's axis i
    inv = [0] * r
    for i, a in enumerate(p1):
        inv[a] = i
    split: list[int] = []
    where: dict[int, int] = {}  # axis of z -> its position in the split x
    for a in range(r):
        for zax in groups[inv[a]]:
            where[zax] = len(split)
            split.append(zs[zax])
    q = [where[zax] for zax in range(len(zs))]  # z = Transpose(split x, q)
    return x, split, [q[k] for k in p2]


def split_before_transpose(
    node: ir.Node, m: tuple[ir.Value, list[int], list[int]], ctx: RuleContext
) -> None:
    x, split, perm = m
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    shape = u.add_initializer(ctx.graph, np.array(split, dtype=np.int64), names("shape"))
    reshape = ir.Node("", "Reshape", [x, shape], name=names(f"{node.name or 'Transpose'}_split"))
    ctx.graph.insert_before(node, reshape)
    out = reshape.outputs[0]
    out.name = names(f"{node.outputs[0].name or 'transposed'}_split")
    out.type = node.outputs[0].type
    out.shape = ir.Shape(split)
    if perm == sorted(perm):
        out.shape = node.outputs[0].shape
        replace_output(node, out, ctx)
        return
    node.replace_input_with(0, out)
    node.attributes["perm"] = ir.AttrInt64s("perm", perm)


def transpose_reshape(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """Check: a Reshape of a Transpose that moves only dims of size 1, so the element order is
    x's own (dims not known to be 1 must keep their relative order)."""
    src = reshape_of("Transpose")(node, ctx)
    if isinstance(src, str):
        return src
    inner = node.inputs[0].producer()  # type: ignore[union-attr]
    assert inner is not None
    dims = u.symbolic_dims(src)
    if dims is None:
        return "the transposed tensor's rank is unknown"
    found = _unit_moves(inner, dims)
    return found if isinstance(found, str) else src
