"""The rotary embedding fusion of pass ``fuse-transformer`` (opset 23).

transformers' ``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Gemma, GPT-NeoX, ...) computes,
for ``x`` of shape ``[batch, heads, seq, D]``::

    emb = Concat(f, f, axis=-1)                       # f: [b, seq, D/2], the angles
    cos = Unsqueeze(Cos(emb) [* s], 1);  sin = Unsqueeze(Sin(emb) [* s], 1)
    y = x * cos + Concat(-x[..., D/2:], x[..., :D/2], axis=-1) * sin

Both halves of ``cos`` and ``sin`` are ``Cos(f)`` and ``Sin(f)``, so ``y`` is
``RotaryEmbedding(x, Cos(f) [* s], Sin(f) [* s])``: the op's first half
``x1 * cos - x2 * sin`` and second half ``x2 * cos + x1 * sin`` are the same products summed
in the same order (the Neg is exact). The op takes its caches as ``[batch, seq, D/2]`` and
onnxruntime does not broadcast them, while the angles of a model that counts positions once
for the batch have batch 1: they are expanded to ``x``'s batch first. The half-size caches
(and their Expand) are made once per angle tensor and shared by every layer's Q and K.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._symbolic_dims import named
from graphtrim.graph.passes._transformer_common import (
    elem_type,
    fusion,
    private,
    producer,
    scalar,
    split_const,
)
from graphtrim.graph.rules import RuleContext, replace
from graphtrim.graph.targets import emits_allowed

_INT64_MAX = np.iinfo(np.int64).max


@dataclasses.dataclass
class Rotary:
    x: ir.Value
    angles: ir.Value  # f: [b, seq, D/2]
    cos_scale: float | None
    sin_scale: float | None
    expand: bool  # the angles have batch 1 and x's batch is not provably 1
    pattern: list[ir.Node]  # read by nothing else: removed with the rewrite


def _trig(value: ir.Value | None, op: str) -> tuple[ir.Value, float | None] | str:
    """``(emb, s)`` for ``Unsqueeze(op(emb) [* s], 1)``."""
    unsq = producer(value, "Unsqueeze")
    if unsq is None or len(unsq.inputs) < 2 or u.const_ints(unsq.inputs[1]) != [1]:
        return f"the {op} table is not unsqueezed at axis 1"
    t = unsq.inputs[0]
    s: float | None = None
    mul = producer(t, "Mul")
    if mul is not None:
        split = split_const(mul)
        if split is None:
            return f"the {op} table is scaled by a computed value"
        s = scalar(split[1])
        if s is None:
            return f"the {op} table is not scaled by a scalar"
        t = split[0]
    node = producer(t, op)
    if node is None or node.inputs[0] is None:
        return f"the table is not {op} of the angles"
    return node.inputs[0], s


def _half_slice(value: ir.Value | None, x: ir.Value, start: int, end: int) -> bool:
    """``value`` is ``x[..., start:end]`` (the end may be any index at or past the last dim)."""
    node = producer(value, "Slice")
    return node is not None and _slice_of(node, x, start, end)


def check_rotary(add: ir.Node, ctx: RuleContext) -> Rotary | str:
    if fusion(ctx).opset < 23 or not emits_allowed(ctx.options.target, "RotaryEmbedding"):
        return "RotaryEmbedding needs opset 23 and a target that takes it"
    muls = [producer(v, "Mul") for v in add.inputs]
    if len(add.inputs) != 2 or muls[0] is None or muls[1] is None:
        return "not a sum of two products"
    # the product whose operand is the Concat is the sine side
    sin_side = None
    for i, mul in enumerate(muls):
        assert mul is not None
        for j in (0, 1):
            if producer(mul.inputs[j], "Concat") is not None:
                sin_side = (i, j)
    if sin_side is None:
        return "no product of a rotated half"
    sin_mul, cos_mul = muls[sin_side[0]], muls[1 - sin_side[0]]
    assert sin_mul is not None and cos_mul is not None
    rot, sin_t = sin_mul.inputs[sin_side[1]], sin_mul.inputs[1 - sin_side[1]]
    cat = producer(rot, "Concat")
    assert cat is not None
    if len(cat.inputs) != 2 or cat.attributes.get_int("axis", 0) not in (-1, 3):
        return "the rotated half is not a Concat of two on the last axis"
    neg = producer(cat.inputs[0], "Neg")
    if neg is None:
        return "the rotated half does not start with a negated half"
    upper = producer(neg.inputs[0], "Slice")
    x = upper.inputs[0] if upper is not None else None
    if x is None or x not in cos_mul.inputs:
        return "the halves are not sliced from the value the cos side multiplies"
    if u.rank(x) != 4 or elem_type(x) != ir.DataType.FLOAT:
        return "x is not a rank-4 float value"
    cos_t = cos_mul.inputs[1] if cos_mul.inputs[0] is x else cos_mul.inputs[0]
    xd = named(x)
    d = xd[3] if xd is not None else None
    if not isinstance(d, int) or d % 2 or d < 2:
        return "x's last dim is not a static even size"
    half = d // 2
    if not _half_slice(neg.inputs[0], x, half, d) or not _half_slice(cat.inputs[1], x, 0, half):
        return "the halves are not x[..., D/2:] and x[..., :D/2]"
    cos_m, sin_m = _trig(cos_t, "Cos"), _trig(sin_t, "Sin")
    if isinstance(cos_m, str):
        return cos_m
    if isinstance(sin_m, str):
        return sin_m
    if cos_m[0] is not sin_m[0]:
        return "cos and sin are not of the same angles"
    emb = producer(cos_m[0], "Concat")
    emb_rank = u.rank(cos_m[0])
    if (
        emb is None
        or emb_rank is None
        or len(emb.inputs) != 2
        or emb.inputs[0] is not emb.inputs[1]
        or emb.attributes.get_int("axis", 0) not in (-1, emb_rank - 1)
    ):
        return "the angles are not Concat(f, f) on the last axis"
    f = emb.inputs[0]
    fd = named(f)
    if f is None or fd is None or len(fd) != 3 or elem_type(f) != ir.DataType.FLOAT:
        return "the angles are not a rank-3 float value"
    assert xd is not None
    if fd[2] != half or fd[1] is None or fd[1] != xd[2]:
        return "the angles are not provably [b, seq, D/2] for x's seq"
    if fd[0] not in (1, xd[0]) or fd[0] is None:
        return "the angles' batch is neither 1 nor x's"
    halves = [producer(neg.inputs[0], "Slice"), producer(cat.inputs[1], "Slice")]
    pattern = [add, cos_mul, sin_mul, cat, neg, *[n for n in halves if n is not None]]
    if not private(pattern, keep=add.outputs[0]):
        return "an intermediate value is read outside the pattern"
    return Rotary(x, f, cos_m[1], sin_m[1], expand=fd[0] != xd[0], pattern=pattern)


def _caches(add: ir.Node, m: Rotary, ctx: RuleContext) -> tuple[ir.Value, ir.Value]:
    """The half-size cos and sin caches of ``m``'s angles, at x's batch; made before ``add``
    on first use and shared afterwards."""
    xd = named(m.x)
    batch = xd[0] if xd is not None else None
    key = (
        id(ctx.graph),  # made in this graph: a subgraph's are not the main graph's
        id(m.angles),
        (batch if batch is not None else id(m.x)) if m.expand else None,
        m.cos_scale,
        m.sin_scale,
    )
    made = fusion(ctx).rotary_caches
    if key in made:
        return made[key]
    graph, namer = ctx.graph, fusion(ctx).new_name
    new: list[ir.Node] = []
    fd = named(m.angles)

    def table(op: str, s: float | None) -> ir.Value:
        node = ir.Node("", op, [m.angles], name=namer(op))
        new.append(node)
        value = node.outputs[0]
        if s is not None:
            c = u.add_initializer(
                graph, np.array(s, dtype=np.float32), namer(f"{op.lower()}_scale")
            )
            mul = ir.Node("", "Mul", [value, c], name=namer("Mul"))
            new.append(mul)
            value = mul.outputs[0]
        return value

    cos, sin = table("Cos", m.cos_scale), table("Sin", m.sin_scale)
    if m.expand:
        # the batch is read from x, or from what x slices channels of (a partial rotation's
        # slice is then read by the op alone, and ``rotary-partial`` removes it)
        src = m.x
        cut = producer(m.x, "Slice")
        if cut is not None and cut.inputs[0] is not None and len(cut.inputs) > 3:
            if u.const_ints(cut.inputs[3]) in ([3], [-1]) and u.rank(cut.inputs[0]) == 4:
                src = cut.inputs[0]
        shape = ir.Node("", "Shape", [src], [ir.AttrInt64("start", 0), ir.AttrInt64("end", 1)])
        ones = u.add_initializer(graph, np.array([1, 1], dtype=np.int64), namer("ones"))
        target = ir.Node("", "Concat", [shape.outputs[0], ones], [ir.AttrInt64("axis", 0)])
        new += [shape, target]
        expanded = []
        for value in (cos, sin):
            e = ir.Node("", "Expand", [value, target.outputs[0]], name=namer("Expand"))
            new.append(e)
            expanded.append(e.outputs[0])
        cos, sin = expanded
    for node in new:
        graph.insert_before(add, node)
    dims = [batch if m.expand else (fd[0] if fd else None), *(fd[1:] if fd else [None, None])]
    for value in (cos, sin):
        value.type = m.angles.type
        value.shape = ir.Shape(dims)
    made[key] = (cos, sin)
    return cos, sin


def fuse_rotary(add: ir.Node, m: Rotary, ctx: RuleContext) -> None:
    cos, sin = _caches(add, m, ctx)
    y = add.outputs[0]
    fused = ir.Node(
        "", "RotaryEmbedding", [m.x, cos, sin], name=fusion(ctx).new_name("RotaryEmbedding")
    )
    ctx.graph.insert_before(add, fused)
    fused.outputs[0].shape = y.shape
    fused.outputs[0].type = y.type
    replace(y, fused.outputs[0], "a rotary embedding")
    # gone at once, not at the next dead-code run: a partial rotation's slice of x is then
    # read by the fused op alone (``rotary-partial`` matches in the same run)
    u.remove_nodes(ctx.graph, m.pattern)


@dataclasses.dataclass
class PartialRotary:
    x: ir.Value
    rotary: ir.Node  # RotaryEmbedding of x[..., :rot]
    dim: int  # rot


def check_partial_rotary(concat: ir.Node, ctx: RuleContext) -> PartialRotary | str:
    """``Concat(RotaryEmbedding(x[..., :r], cos, sin), x[..., r:], axis=-1)`` (partial rotary
    embeddings: Phi, GPT-NeoX) is ``RotaryEmbedding(x, cos, sin, rotary_embedding_dim=r)``: the
    op rotates the first ``r`` channels and passes the rest through."""
    if fusion(ctx).opset < 23 or not emits_allowed(ctx.options.target, "RotaryEmbedding"):
        return "RotaryEmbedding needs opset 23 and a target that takes it"
    if len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (-1, 3):
        return "not a Concat of two on the last axis"
    rope = producer(concat.inputs[0], "RotaryEmbedding")
    if rope is None or rope.domain not in ("", "ai.onnx") or rope.inputs[0] is None:
        return "the first part is not a RotaryEmbedding"
    if len(rope.inputs) > 3 or set(rope.attributes) - {"interleaved", "rotary_embedding_dim"}:
        return "the RotaryEmbedding reads position ids or has heads given"
    head = producer(rope.inputs[0], "Slice")
    rest = producer(concat.inputs[1], "Slice")
    if head is None or rest is None or head.inputs[0] is None:
        return "the parts are not slices"
    x = head.inputs[0]
    xd = named(x)
    if xd is None or len(xd) != 4 or not isinstance(xd[3], int):
        return "x is not rank 4 with a static last dim"
    rd = named(rope.inputs[0])
    r = rd[3] if rd is not None and len(rd) == 4 else None
    if not isinstance(r, int) or not 0 < r < xd[3]:
        return "the rotated part's width is not known"
    if rope.attributes.get_int("rotary_embedding_dim", 0) not in (0, r):
        return "the RotaryEmbedding rotates part of its input already"
    if not _slice_of(head, x, 0, r) or not _slice_of(rest, x, r, xd[3]):
        return "the parts are not x[..., :r] and x[..., r:]"
    if not private([head, rope, rest, concat], keep=concat.outputs[0]):
        return "a part is read outside the pattern"
    return PartialRotary(x, rope, r)


def _slice_of(node: ir.Node, x: ir.Value, start: int, end: int) -> bool:
    """``node`` is ``x[..., start:end]`` (an end at or past the last dim for the tail)."""
    if node.inputs[0] is not x or len(node.inputs) < 4:
        return False
    starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
    axes = u.const_ints(node.inputs[3])
    steps = u.const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if starts != [start] or ends is None or len(ends) != 1 or axes not in ([3], [-1]):
        return False
    xd = named(x)
    width = xd[3] if xd is not None else None
    return steps == [1] and (ends[0] == end or (end == width and ends[0] >= end))


def fuse_partial_rotary(concat: ir.Node, m: PartialRotary, ctx: RuleContext) -> None:
    y = concat.outputs[0]
    attrs = [ir.AttrInt64("rotary_embedding_dim", m.dim)]
    interleaved = m.rotary.attributes.get_int("interleaved", 0)
    if interleaved:
        attrs.append(ir.AttrInt64("interleaved", interleaved))
    fused = ir.Node(
        "",
        "RotaryEmbedding",
        [m.x, *m.rotary.inputs[1:3]],
        attrs,
        name=fusion(ctx).new_name("RotaryEmbedding"),
    )
    ctx.graph.insert_before(concat, fused)
    fused.outputs[0].shape = y.shape
    fused.outputs[0].type = y.type
    replace(y, fused.outputs[0], "a partial rotary embedding")
