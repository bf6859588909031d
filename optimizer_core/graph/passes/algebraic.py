"""Algebraic simplification (``algebraic``).

Exact rules, applied only when broadcasting cannot change the output shape:

- ``x + 0 -> x``, ``0 + x -> x``, ``x - 0 -> x``, ``x * 1 -> x``, ``1 * x -> x``, ``x / 1 -> x``,
  ``x ** 1 -> x``; on booleans ``x and True``, ``x or False``, ``x xor False`` (either order) -> ``x``.
  A ``* 1`` stays where it is the scale of a normalization written out below the opset of its
  op: onnxruntime fuses such a pattern into one kernel only with its scale ``Mul``.
- ``Neg(Neg(x)) -> x``, ``Not(Not(x)) -> x``
- ``Transpose(Transpose(x, p), q) -> Transpose(x, p[q])`` and ``-> x`` when ``p[q]`` is the identity
- ``Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, a')`` (opset 13+), ``a'`` the positions of both
- ``Reshape(R(x), s) -> Reshape(x, s)`` for ``R`` in Reshape/Flatten/Squeeze/Unsqueeze when ``s``
  copies no dim (no 0 entry): a Reshape reads only the element order, which ``R`` keeps.
- ``Squeeze(Split(Transpose(x, p), a)[i], a) -> Transpose(Gather(x, i, p[a]), p')`` for an
  unbind into pieces of size 1: each piece is transposed on its own, one rank lower.
- ``Where(c, a, b)`` of 1-D values under a constant condition -> the entries it picks, as one
  computed piece or a Concat: TorchScript writes ``x.expand(B, -1, -1)`` as
  ``Where(Equal(s, -1), 1, s)`` over ``s = Concat(B, -1, -1)``, whose condition is known.

The rules that round differently (merging constant chains, ``Reciprocal`` pairs) are the
``reassociate`` pass (:mod:`graphtrim.graph.passes.reassociate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_norm import runtime_fused_scale
from graphtrim.graph.rules import (
    Rule,
    RuleContext,
    RulePass,
    replace,
    replace_output,
    reroute_refusal,
)

__all__ = ["RULES", "AlgebraicSimplification"]


def _broadcast_keeps_shape(x: ir.Value, c: ir.Value) -> bool:
    """Broadcasting ``x`` with constant ``c`` yields exactly the shape of ``x``."""
    c_shape = u.const_shape(c)
    if c_shape is None:
        return False
    if len(c_shape) == 0:
        return True
    x_dims = u.symbolic_dims(x)
    if x_dims is None and len(c_shape) == 1:
        # a vector c (a bias, a normalization's weight) keeps the shape of any x whose last dim
        # is c's length (or c has one element) and whose rank is at least 1
        d = u.last_dim(x)
        return d is not None and (c_shape[0] == 1 or d == c_shape[0])
    if x_dims is None or len(c_shape) > len(x_dims):
        return False
    for cd, xd in zip(reversed(c_shape), reversed(x_dims), strict=False):
        if cd != 1 and not (isinstance(xd, int) and xd == cd):
            return False
    return True


def _same_dtype(a: ir.Value, b: ir.Value) -> bool:
    return a.dtype is None or b.dtype is None or a.dtype == b.dtype


def _neutral(operand: int, neutral: float) -> Callable[[ir.Node, RuleContext], Any]:
    """Check: input ``operand`` is the neutral element for the other input, which the output
    then equals."""

    def check(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
        if len(node.inputs) != 2:
            return "not two inputs"
        x, c = node.inputs[1 - operand], node.inputs[operand]
        if x is None or c is None:
            return "an input is missing"
        if not u.is_all(c, neutral):
            return f"input {operand} is not a constant {neutral:g}"
        if not _broadcast_keeps_shape(x, c):
            return "broadcasting may change the shape"
        if not _same_dtype(x, node.outputs[0]):
            return "the output's type differs from the operand's"
        if node.op_type == "Mul" and runtime_fused_scale(x, c, u.node_opset(node, ctx.model)):
            return "the scale of a written-out normalization, which onnxruntime fuses with it"
        return reroute_refusal(node.outputs[0], x) or x

    return check


def _involution(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """``f(f(x)) -> x`` for the node's own op ``f``."""
    x = node.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None or not u.is_op(producer, node.op_type) or producer.inputs[0] is None:
        return f"the input is not produced by {node.op_type}"
    src = producer.inputs[0]
    return reroute_refusal(node.outputs[0], src) or src


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


def _transpose_cancel(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    pair = _transpose_pair(node)
    if isinstance(pair, str):
        return pair
    src, composed = pair
    if composed != list(range(len(composed))):
        return "the composed permutation is not the identity"
    return reroute_refusal(node.outputs[0], src) or src


def _transpose_compose(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
    # also where the pair cancels but a graph input would have to become a graph output
    return _transpose_pair(node)


def _compose_transposes(node: ir.Node, match: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
    src, composed = match
    node.replace_input_with(0, src)
    node.attributes["perm"] = ir.AttrInt64s("perm", composed)


@dataclasses.dataclass
class _AroundUnsqueeze:
    x: ir.Value
    axes: list[int]  # of the new Unsqueeze of x
    perm: list[int] | None  # of the Transpose after it; None: the identity (no Transpose)


def _transposes_around_unsqueeze(node: ir.Node, ctx: RuleContext) -> _AroundUnsqueeze | str:
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


def _unsqueeze_then_transpose(node: ir.Node, m: _AroundUnsqueeze, ctx: RuleContext) -> None:
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


def _after_reshape(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
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


def _one_reshape(node: ir.Node, m: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
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
    ctx.graph.insert_before(node, merged)
    merged.outputs[0].name = names(f"{node.outputs[0].name or 'reshaped'}_merged")
    merged.outputs[0].type = node.outputs[0].type
    merged.outputs[0].shape = node.outputs[0].shape
    replace_output(node, merged.outputs[0], ctx)


def _slice_params(node: ir.Node, rank: int) -> list[list[int]] | None:
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


def _slice_pair(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[list[int]]] | str:
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
    inner_p = _slice_params(inner, rank)
    if inner_p is None:
        return "parameters not constant or axes out of range"
    merged = None
    for user, index in y.uses():
        outer_p = _slice_params(user, rank) if u.is_op(user, "Slice") and index == 0 else None
        if outer_p is None:
            return "the inner result is read elsewhere than as the data of Slices with constant parameters"
        if set(outer_p[2]) & set(inner_p[2]) or len(set(outer_p[2])) != len(outer_p[2]):
            return "the Slices share an axis"
        if user is node:
            merged = [a + b for a, b in zip(inner_p, outer_p, strict=True)]
    assert merged is not None
    return inner.inputs[0], merged


def _merge_slices(node: ir.Node, m: tuple[ir.Value, list[list[int]]], ctx: RuleContext) -> None:
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


def _unit_transpose(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    """Check: a Transpose that moves only dims of size 1 (the others keep their order), so it
    keeps the element order; the match is a constant Reshape target for its output: static
    sizes, 0 for a symbolic dim that stays in place, at most one -1."""
    x = node.inputs[0]
    dims = u.symbolic_dims(x) if x is not None else None
    if x is None or dims is None:
        return "the rank is unknown"
    perm = u.perm_of(node, len(dims))
    if perm is None:
        return "the permutation is invalid for the rank"
    moved = [axis for axis in perm if dims[axis] != 1]
    if moved != sorted(moved):
        return "the Transpose reorders dims that may not be 1"
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


def _as_reshape(node: ir.Node, target: list[int], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    shape = u.add_initializer(ctx.graph, np.array(target, dtype=np.int64), names("shape"))
    reshape = ir.Node(
        "", "Reshape", [node.inputs[0], shape], name=names(f"{node.name or 'Transpose'}_reshape")
    )
    ctx.graph.insert_before(node, reshape)
    reshape.outputs[0].name = names(f"{node.outputs[0].name or 'transposed'}_reshaped")
    reshape.outputs[0].type = node.outputs[0].type
    reshape.outputs[0].shape = node.outputs[0].shape
    replace_output(node, reshape.outputs[0], ctx)


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


def _transpose_split_transpose(
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


def _split_before_transpose(
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


def _unsqueeze_pair(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[int]] | str:
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


def _merge_unsqueezes(node: ir.Node, match: tuple[ir.Value, list[int]], ctx: RuleContext) -> None:
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


def _reshape_of(op: str) -> Callable[[ir.Node, RuleContext], Any]:
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


def _static_copies(node: ir.Node, ctx: RuleContext) -> list[int] | str:
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


def _write_copies(node: ir.Node, shape: list[int], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    target = u.add_initializer(ctx.graph, np.array(shape, dtype=np.int64), names("shape_static"))
    node.replace_input_with(1, target)


def _transpose_reshape(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    """Check: a Reshape of a Transpose that moves only dims of size 1, so the element order is
    x's own (dims not known to be 1 must keep their relative order)."""
    src = _reshape_of("Transpose")(node, ctx)
    if isinstance(src, str):
        return src
    inner = node.inputs[0].producer()  # type: ignore[union-attr]
    assert inner is not None
    dims = u.symbolic_dims(src)
    if dims is None:
        return "the transposed tensor's rank is unknown"
    perm = u.perm_of(inner, len(dims))
    if perm is None:
        return "the permutation is invalid for the rank"
    moved = [axis for axis in perm if dims[axis] != 1]
    if moved != sorted(moved):
        return "the Transpose reorders dims that may not be 1"
    return src


def _concat_axis(node: ir.Node) -> int | None:
    axis = node.attributes.get_int("axis", 0)
    if axis >= 0:
        return axis
    r = u.rank(node.outputs[0])
    return None if r is None else axis + r


def _concat_of_concat(node: ir.Node, ctx: RuleContext) -> list[ir.Value] | str:
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


def _flatten_concat(node: ir.Node, flat: list[ir.Value], ctx: RuleContext) -> None:
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    merged = ir.Node(
        "",
        "Concat",
        flat,
        [ir.AttrInt64("axis", node.attributes.get_int("axis", 0))],
        name=names(f"{node.name or 'Concat'}_flat"),
    )
    ctx.graph.insert_before(node, merged)
    merged.outputs[0].name = names(f"{node.outputs[0].name or 'concat'}_flat")
    merged.outputs[0].type = node.outputs[0].type
    merged.outputs[0].shape = node.outputs[0].shape
    replace_output(node, merged.outputs[0], ctx)


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


def _where_select(node: ir.Node, ctx: RuleContext) -> _Selection | str:
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


def _write_selection(node: ir.Node, pieces: _Selection, ctx: RuleContext) -> None:
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


def _unbind_of_transpose(node: ir.Node, ctx: RuleContext) -> _Unbind | str:
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


def _sliced_unbind_of_transpose(node: ir.Node, ctx: RuleContext) -> _Unbind | str:
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
        params = _slice_params(user, r)
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


def _unbind_before_transpose(node: ir.Node, m: _Unbind, ctx: RuleContext) -> None:
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


def _read_source(node: ir.Node, src: ir.Value, ctx: RuleContext) -> None:
    node.replace_input_with(0, src)


_BROADCAST = "when broadcasting keeps x's shape and the output has x's dtype"

RULES: tuple[Rule, ...] = (
    Rule("x+0", f"x + 0 -> x {_BROADCAST}", ("Add",), _neutral(1, 0), replace_output),
    Rule("0+x", f"0 + x -> x {_BROADCAST}", ("Add",), _neutral(0, 0), replace_output),
    Rule("x-0", f"x - 0 -> x {_BROADCAST}", ("Sub",), _neutral(1, 0), replace_output),
    Rule("x*1", f"x * 1 -> x {_BROADCAST}", ("Mul",), _neutral(1, 1), replace_output),
    Rule("1*x", f"1 * x -> x {_BROADCAST}", ("Mul",), _neutral(0, 1), replace_output),
    Rule("x/1", f"x / 1 -> x {_BROADCAST}", ("Div",), _neutral(1, 1), replace_output),
    Rule("x**1", f"x ** 1 -> x {_BROADCAST}", ("Pow",), _neutral(1, 1), replace_output),
    # the masks of attention exports: `And(True, x)` where a mask term is always true
    Rule("x-and-true", f"And(x, True) -> x {_BROADCAST}", ("And",), _neutral(1, 1), replace_output),
    Rule("true-and-x", f"And(True, x) -> x {_BROADCAST}", ("And",), _neutral(0, 1), replace_output),
    Rule("x-or-false", f"Or(x, False) -> x {_BROADCAST}", ("Or",), _neutral(1, 0), replace_output),
    Rule("false-or-x", f"Or(False, x) -> x {_BROADCAST}", ("Or",), _neutral(0, 0), replace_output),
    Rule(
        "x-xor-false", f"Xor(x, False) -> x {_BROADCAST}", ("Xor",), _neutral(1, 0), replace_output
    ),
    Rule(
        "false-xor-x", f"Xor(False, x) -> x {_BROADCAST}", ("Xor",), _neutral(0, 0), replace_output
    ),
    Rule("neg-neg", "Neg(Neg(x)) -> x", ("Neg",), _involution, replace_output),
    Rule("not-not", "Not(Not(x)) -> x", ("Not",), _involution, replace_output),
    Rule(
        "transpose-transpose-cancel",
        "Transpose(Transpose(x, p), q) -> x when p[q] is the identity",
        ("Transpose",),
        _transpose_cancel,
        replace_output,
    ),
    Rule(
        "transpose-transpose-compose",
        "Transpose(Transpose(x, p), q) -> Transpose(x, p[q]) (absent perms reverse the axes)",
        ("Transpose",),
        _transpose_compose,
        _compose_transposes,
    ),
    Rule(
        "transpose-unsqueeze-transpose",
        "Transpose(Unsqueeze(Transpose(x, p), a), q) -> Unsqueeze(x, a') (Transpose(.., q') "
        "after it unless the permutations cancel): a' are the positions of the output's unit "
        "dims, q' orders x's axes as p and q do; each inner result read once (opset 13+)",
        ("Transpose",),
        _transposes_around_unsqueeze,
        _unsqueeze_then_transpose,
    ),
    *(
        Rule(
            f"reshape-{op.lower()}",
            f"{op}(Reshape(x, s), a) -> Reshape(x, s') for a constant s that copies no dim: s' "
            + (
                "is s with 1s inserted at the axes"
                if op == "Unsqueeze"
                else "is s without its entries at the axes, each 1"
            )
            + "; the Reshape's result read there alone (opset 13+)",
            (op,),
            _after_reshape,
            _one_reshape,
        )
        for op in ("Unsqueeze", "Squeeze")
    ),
    Rule(
        "transpose-unit-reshape",
        "Transpose(x, p) -> Reshape(x, s) when p moves only dims of size 1 (the others keep "
        "their order, so the element order is x's); s holds the static sizes, 0 for a symbolic "
        "dim that stays in place and at most one -1 (a Reshape moves no data)",
        ("Transpose",),
        _unit_transpose,
        _as_reshape,
    ),
    Rule(
        "transpose-split-transpose",
        "Transpose(Reshape(Transpose(x, p1), s), p2) -> Transpose(Reshape(x, s'), p) where the "
        "Reshape only splits axes (static shapes): s' splits x's axes alike, p is p1 and p2 "
        "composed over the split axes; the Transpose goes too when p keeps the order "
        "(flatten, transpose, view into heads, permute: a single view)",
        ("Transpose",),
        _transpose_split_transpose,
        _split_before_transpose,
    ),
    Rule(
        "transpose-unbind",
        "Squeeze(Split(Transpose(x, p), a)[i], a) -> Transpose(Gather(x, i, p[a]), p') for "
        "pieces proved of size 1, each read by such a Squeeze alone: p' is p without axis a "
        "(no Transpose when that keeps the order). Each piece is transposed on its own at one "
        "rank less, the same data moved, and its Transpose can merge with the ones after it "
        "(q @ k.transpose(-2, -1)) or into a MatMul's transA/transB",
        ("Split",),
        _unbind_of_transpose,
        _unbind_before_transpose,
    ),
    Rule(
        "transpose-unbind-slices",
        "Squeeze(Slice(Transpose(x, p), [i, i+1), a), a) -> Transpose(Gather(x, i, p[a]), p') "
        "where every reader of the Transpose is such a Slice of one element along the same "
        "axis, each read by such a Squeeze alone (the unbind as torch's dynamo exporter writes "
        "it); p' as for transpose-unbind",
        ("Transpose",),
        _sliced_unbind_of_transpose,
        _unbind_before_transpose,
    ),
    Rule(
        "slice-slice",
        "Slice(Slice(x, s1, e1, a1, t1), s2, e2, a2, t2) -> Slice(x, s1+s2, e1+e2, a1+a2, "
        "t1+t2) (lists joined) for constant parameters on disjoint axes: slicing one axis does "
        "not move the others; the inner result read by such Slices alone, each merged (opset 10+)",
        ("Slice",),
        _slice_pair,
        _merge_slices,
    ),
    Rule(
        "unsqueeze-unsqueeze",
        "Unsqueeze(Unsqueeze(x, a), b) -> Unsqueeze(x, b + the positions of a among the axes "
        "b leaves), for constant axes (inputs from opset 13, attributes before)",
        ("Unsqueeze",),
        _unsqueeze_pair,
        _merge_unsqueezes,
    ),
    Rule(
        "reshape-static-copy",
        "Reshape(x, s) -> Reshape(x, s') where s (constant, allowzero 0) copies a dim of x that "
        "is static: s' writes that size (the same shape), so the Reshape no longer depends on "
        "how x was produced",
        ("Reshape",),
        _static_copies,
        _write_copies,
    ),
    *(
        Rule(
            f"{op.lower()}-reshape",
            f"Reshape({op}(x), s) -> Reshape(x, s) when s is constant and copies no dim (no 0 "
            f"entry, or allowzero=1) but ones x has at the same position (the same static size "
            f"or name): a Reshape reads only the element order, which {op} keeps"
            + (
                "; or s is computed (Shape(y)), the inner Reshape flattens, and each entry "
                "that may be 0 at run time is x's dim at its position"
                if op == "Reshape"
                else ""
            ),
            ("Reshape",),
            _reshape_of(op),
            _read_source,
        )
        for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
    ),
    Rule(
        "concat-concat",
        "Concat(a, Concat(b, c, axis), d, axis) -> Concat(a, b, c, d, axis) when every reader "
        "of the inner Concat is a Concat on the same axis (it goes dead)",
        ("Concat",),
        _concat_of_concat,
        _flatten_concat,
    ),
    Rule(
        "transpose-reshape",
        "Reshape(Transpose(x, p), s) -> Reshape(x, s) when p moves only dims of size 1 (the "
        "element order is x's) and s is constant and copies no dim",
        ("Reshape",),
        _transpose_reshape,
        _read_source,
    ),
    Rule(
        "where-constant-select",
        "Where(c, a, b) of 1-D values with a constant condition c -> the picked entries: the "
        "one computed piece they are, or Concat(pieces, constant runs) when a side's Concat "
        "goes dead (each computed piece, a side or a Concat input, picked whole and in order)",
        ("Where",),
        _where_select,
        _write_selection,
    ),
)


class AlgebraicSimplification(RulePass):
    name = "algebraic"
    summary = (
        "x+0, x-0, x*1, x/1, x**1, double Neg/Not, Transposes (pairs, unbinds), Reshape chains"
    )
    rules = RULES
