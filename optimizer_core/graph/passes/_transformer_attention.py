"""The attention fusion of pass ``fuse-transformer``: ``Softmax(Q @ K^T * scale [+ mask]) @ V``
on rank-4 ``[batch, heads, seq, head]`` values -> ``Attention(Q, K, V, mask, scale=scale)``
(opset 23)."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_common import (
    elem_type,
    fusion,
    private,
    producer,
    scalar,
    sole_reader,
    split_const,
)
from graphtrim.graph.rules import RuleContext, replace
from graphtrim.graph.targets import emits_allowed


def _scaled(value: ir.Value | None) -> tuple[ir.Value | None, float, list[ir.Node]]:
    """``(x, c, nodes)`` when ``value`` is ``x * c`` (or ``x / (1/c)``) for a scalar ``c``,
    else ``(value, 1.0, [])``."""
    node = producer(value, "Mul", "Div")
    split = split_const(node) if node is not None else None
    if node is None or split is None or value is None or len(value.uses()) != 1:
        return value, 1.0, []
    c = scalar(split[1])
    if c is None or c == 0.0:
        return value, 1.0, []
    return split[0], (c if node.op_type == "Mul" else 1.0 / c), [node]


def _mask_fits(mask: ir.Value, q: ir.Value, k: ir.Value, k_perm: list[int] | None) -> bool:
    """onnxruntime's Attention broadcasts a mask over batch and heads only: its last two
    dims must be the query and key lengths (provably, by static size or dim name)."""
    md, qd, kd = u.symbolic_dims(mask), u.symbolic_dims(q), u.symbolic_dims(k)
    if md is None or qd is None or kd is None or not 2 <= len(md) <= 4:
        return False
    k_seq = kd[1] if k_perm is not None else kd[2]
    return all(m is not None and m == want for m, want in ((md[-2], qd[2]), (md[-1], k_seq)))


@dataclasses.dataclass
class Attention:
    q: ir.Value
    k: ir.Value
    v: ir.Value
    mask: ir.Value | None
    k_perm: list[int] | None  # K's layout is [batch, seq, heads, head]: move heads forward
    scale: float
    out_mm: ir.Node  # the final MatMul (the fused op goes before it)


def check_attention(softmax: ir.Node, ctx: RuleContext) -> Attention | str:
    if fusion(ctx).opset < 23 or not emits_allowed(ctx.options.target, "Attention"):
        return "Attention needs opset 23 and a target that takes it"
    x = softmax.inputs[0]
    axis = softmax.attributes.get_int("axis", -1)
    if x is None or u.rank(x) != 4 or axis not in (-1, 3):
        return "not a Softmax over the last axis of a rank-4 value"
    p = softmax.outputs[0]
    out_mm = sole_reader(p, "MatMul")
    if out_mm is None or out_mm.inputs[0] is not p:
        return "the probabilities are not the left operand of a MatMul reading them alone"
    v = out_mm.inputs[1]
    nodes: list[ir.Node] = [softmax, out_mm]
    mask = None
    scores: ir.Value | None = x
    add = producer(x, "Add")
    if add is not None and len(x.uses()) == 1:
        a, b = add.inputs
        mm_side = a if producer(a, "MatMul", "Mul", "Div") is not None else b
        mask = b if mm_side is a else a
        if mask is None or mm_side is None or producer(mask, "MatMul") is not None:
            return "the mask is missing or a product"
        scores, nodes = mm_side, [*nodes, add]
    scores, post, post_nodes = _scaled(scores)
    mm = producer(scores, "MatMul")
    if mm is None or scores is None or len(scores.uses()) != 1:
        return "the scores are not a MatMul read once"
    q, q_scale, q_nodes = _scaled(mm.inputs[0])
    kt, k_scale, k_nodes = _scaled(mm.inputs[1])
    trans = producer(kt, "Transpose")
    if trans is None or kt is None or len(kt.uses()) != 1:
        return "K is not transposed by a Transpose read once"
    perm = list(trans.attributes.get_ints("perm", []))
    k_src = trans.inputs[0]
    if perm == [0, 1, 3, 2]:
        k_perm = None  # K is [batch, heads, seq, head] already
    elif perm == [0, 2, 3, 1]:
        k_perm = [0, 2, 1, 3]  # K is [batch, seq, heads, head]: move heads forward
    else:
        return "K's transpose is not [0, 1, 3, 2] or [0, 2, 3, 1]"
    if any(u.rank(t) != 4 for t in (q, k_src, v)) or q is None or k_src is None or v is None:
        return "Q, K or V is not rank 4"
    if not all(elem_type(t) == ir.DataType.FLOAT for t in (q, k_src, v)):
        return "Q, K or V is not float"
    if mask is not None and elem_type(mask) not in (ir.DataType.FLOAT, ir.DataType.BOOL):
        return "the mask is not float or bool"
    if mask is not None and not _mask_fits(mask, q, k_src, k_perm):
        return "the mask's last two dims are not provably the query and key lengths"
    pattern = [*nodes, *post_nodes, mm, *q_nodes, *k_nodes, trans]
    if not private(pattern, keep=out_mm.outputs[0]):
        return "an intermediate value is read outside the pattern"
    return Attention(q, k_src, v, mask, k_perm, post * q_scale * k_scale, out_mm)


def fuse_attention(softmax: ir.Node, m: Attention, ctx: RuleContext) -> None:
    graph, out_mm = ctx.graph, m.out_mm
    y = out_mm.outputs[0]
    k_src = m.k
    if m.k_perm is not None:
        move = ir.Node("", "Transpose", [k_src], [ir.AttrInt64s("perm", m.k_perm)])
        graph.insert_before(out_mm, move)
        kd = u.symbolic_dims(k_src)
        if kd is not None:
            move.outputs[0].shape = ir.Shape([kd[i] for i in m.k_perm])
        move.outputs[0].type = k_src.type
        k_src = move.outputs[0]
    inputs: list[ir.Value | None] = [m.q, k_src, m.v]
    if m.mask is not None:
        inputs.append(m.mask)
    fused = ir.Node(
        "",
        "Attention",
        inputs,
        [ir.AttrFloat32("scale", m.scale)],
        name=fusion(ctx).new_name("Attention"),
    )
    graph.insert_before(out_mm, fused)
    fused.outputs[0].shape = y.shape
    fused.outputs[0].type = y.type
    replace(y, fused.outputs[0], "an attention pattern")
