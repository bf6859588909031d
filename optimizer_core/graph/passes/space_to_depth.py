"""Strided-slice space-to-depth blocks become one ``SpaceToDepth``.

YOLOv5's first releases (and other detectors since) start with a "focus" block: four strided
slices of the image, ``x[..., a::2, b::2]`` for the four offsets ``(a, b)``, concatenated on the
channels. That is ``SpaceToDepth(x, blocksize=2)`` up to the order of the channel blocks:
``SpaceToDepth`` puts offset ``(a, b)`` at block ``2a + b``; when the concatenation lists the
offsets in another order, a ``Gather`` on the channels reorders them (and ``fuse-channel-gather``
then folds that into the ``Conv`` that reads it). Six or eight nodes become one or two; the
rewrite moves data only, so it is exact.

Matched: a ``Concat`` on axis 1 of four values, each one ``Slice`` or two chained ``Slice`` nodes
of the same rank-4 float tensor with constant parameters that together slice axes 2 and 3 only,
with step 2, start 0 or 1 and an end at or past the dim, the four offsets all different.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace_output

_TO_END = 2**31 - 1  # an end this large reads to the end of any dim


def _slices(value: ir.Value | None) -> tuple[ir.Value, dict[int, tuple[int, int, int]]] | str:
    """The source of a chain of at most two constant Slices and what they slice per axis."""
    sliced: dict[int, tuple[int, int, int]] = {}
    for _ in range(2):
        node = value.producer() if value is not None else None
        if node is None or not u.is_op(node, "Slice") or len(node.inputs) < 3:
            break
        starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
        axes = u.const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
        steps = u.const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
        if starts is None or ends is None:
            return "a slice parameter is not constant"
        if (len(node.inputs) > 3 and node.inputs[3] is not None and axes is None) or (
            len(node.inputs) > 4 and node.inputs[4] is not None and steps is None
        ):
            return "a slice parameter is not constant"
        axes = list(range(len(starts))) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
            axis = axis + 4 if axis < 0 else axis
            if axis in sliced:
                return "an axis is sliced twice"
            sliced[axis] = (start, end, step)
        value = node.inputs[0]
    if not sliced or value is None:
        return "an input is not a strided slice"
    return value, sliced


def _focus(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, list[tuple[int, int]]] | str:
    if len(node.inputs) != 4 or node.attributes.get_int("axis", 0) not in (1, -3):
        return "not a Concat of four values on the channels"
    source: ir.Value | None = None
    offsets: list[tuple[int, int]] = []
    for value in node.inputs:
        found = _slices(value)
        if isinstance(found, str):
            return found
        x, sliced = found
        if source is not None and x is not source:
            return "the slices read different tensors"
        source = x
        if set(sliced) != {2, 3}:
            return "the slices do not cut exactly the two spatial axes"
        dims = u.dims(x)
        for axis in (2, 3):
            start, end, step = sliced[axis]
            dim = dims[axis] if dims is not None and len(dims) == 4 else None
            if step != 2 or start not in (0, 1):
                return "not a step-2 slice from offset 0 or 1"
            if end < _TO_END and (dim is None or end < dim):
                return "a slice stops before the end of its dim"
        offsets.append((sliced[2][0], sliced[3][0]))
    assert source is not None
    if len(set(offsets)) != 4:
        return "the four offsets are not all different"
    if u.rank(source) != 4:
        return "the sliced tensor is not known to be rank 4"
    if source.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return "SpaceToDepth is matched for float and double tensors only"
    if offsets != sorted(offsets):
        channels = (u.dims(source) or [None, None])[1]
        if not isinstance(channels, int):
            return "the channel count is not static (needed to reorder the blocks)"
    return source, offsets


def _s2d_shape(x: ir.Value) -> ir.Shape | None:
    dims = u.symbolic_dims(x)
    if dims is None or len(dims) != 4:
        return None
    n, c, h, w = dims
    return ir.Shape(
        [
            n,
            c * 4 if isinstance(c, int) else None,
            h // 2 if isinstance(h, int) else None,
            w // 2 if isinstance(w, int) else None,
        ]
    )


def _to_space_to_depth(
    node: ir.Node, match: tuple[ir.Value, list[tuple[int, int]]], ctx: RuleContext
) -> None:
    x, offsets = match
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    s2d = ir.Node(
        "", "SpaceToDepth", [x], [ir.AttrInt64("blocksize", 2)], name=names("SpaceToDepth")
    )
    ctx.graph.insert_before(node, s2d)
    out = s2d.outputs[0]
    out.name = names("space_to_depth")
    out.type = x.type
    # the blocks in another order: the same shape as the Concat's
    out.shape = node.outputs[0].shape or _s2d_shape(x)
    if offsets != sorted(offsets):
        channels = u.dims(x)[1]  # type: ignore[index]
        assert isinstance(channels, int)
        index = np.concatenate([(2 * a + b) * channels + np.arange(channels) for a, b in offsets])
        indices = u.add_initializer(ctx.graph, index.astype(np.int64), names("focus_order"))
        gather = ir.Node(
            "", "Gather", [out, indices], [ir.AttrInt64("axis", 1)], name=names("Gather")
        )
        ctx.graph.insert_before(node, gather)
        out = gather.outputs[0]
        out.name = names("focus")
        out.type = x.type
    out.shape = node.outputs[0].shape
    replace_output(node, out, ctx)


RULES: tuple[Rule, ...] = (
    Rule(
        "focus-space-to-depth",
        "Concat(x[..., a::2, b::2] for the four offsets (a, b), axis=1) -> "
        "SpaceToDepth(x, 2), then Gather on the channels when the offsets are not in "
        "SpaceToDepth's order (block 2a + b)",
        ("Concat",),
        _focus,
        _to_space_to_depth,
    ),
)


class SpaceToDepthBlocks(RulePass):
    name = "space-to-depth"
    summary = "four strided slices concatenated on the channels -> SpaceToDepth"
    rules = RULES
