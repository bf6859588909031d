"""Moving per-tensor QuantizeLinear / DequantizeLinear across data movement (pass ``qdq-move``).

``qdq`` (see :mod:`graphtrim.graph.passes.qdq`, which states the math) plus:

- ``dq-sink`` of any tensor, not only of constants: ``M(DQ(x, s, zp)) -> DQ(M(x), s, zp)``;
- ``q-hoist``: ``Q(M(y), s, zp) -> M(Q(y, s, zp))``;

for a data-movement op ``M`` (Reshape, Transpose, Squeeze, Unsqueeze, Flatten) whose output has
no other reader and per-tensor parameters (Q and DQ then act on every element alike, so they
commute with any op that only moves elements). A chain ``DQ -> M -> Q`` becomes ``M -> DQ -> Q``
(or ``DQ -> Q -> M``), which ``dq-q`` then removes.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._qdq import (
    DATA_MOVEMENT,
    MOVABLE_TYPES,
    clone,
    copy_shape,
    params,
    per_tensor,
)
from graphtrim.graph.passes.qdq import (
    DQ_Q,
    Q_DQ_LOSSY,
    QdqCleanup,
    check_dq_sink,
    new_name,
    sink_dq,
)
from graphtrim.graph.rules import Rule, RuleContext, replace


def check_q_hoist(q: ir.Node, ctx: RuleContext) -> tuple[ir.Node, ir.DataType] | str:
    """The data-movement op ``M`` of ``Q(M(y))`` and the quantized type."""
    if u.is_dead(q):
        return "the node is dead (an earlier rewrite rerouted its readers)"
    mid = q.inputs[0]
    move = mid.producer() if mid is not None else None
    if mid is None or move is None or move.inputs[0] is None:
        return "the input has no producer"
    if not u.is_op(move, *DATA_MOVEMENT):
        return "the input is not a data-movement op"
    if not u.single_consumer(mid):
        return "the data-movement op's output has other readers"
    p = params(q)
    if p is None or p.qtype not in MOVABLE_TYPES or not per_tensor(p):
        return "not per-tensor parameters of an 8- or 16-bit integer type"
    return move, p.qtype


def hoist_q(q: ir.Node, match: tuple[ir.Node, ir.DataType], ctx: RuleContext) -> None:
    """``Q(M(y), s, zp) -> M(Q(y, s, zp))``."""
    move, qtype = match
    mid = q.inputs[0]
    y = move.inputs[0]
    assert mid is not None and y is not None
    old = q.outputs[0]
    new_q = clone(q, [y, *q.inputs[1:]], new_name(ctx, y.name, "q"), qtype)
    new_q.outputs[0].shape = copy_shape(y.shape)
    moved = clone(
        move, [new_q.outputs[0], *move.inputs[1:]], new_name(ctx, old.name, "moved"), qtype
    )
    moved.outputs[0].shape = copy_shape(old.shape or mid.shape)
    ctx.graph.insert_before(q, [new_q, moved])
    replace(old, moved.outputs[0], move.op_type)


RULES: tuple[Rule, ...] = (
    DQ_Q,
    Rule(
        "q-hoist",
        "Q(M(y), s, zp) -> M(Q(y, s, zp)) for per-tensor s and zp of an 8- or 16-bit integer "
        "type and M in {Reshape, Transpose, Squeeze, Unsqueeze, Flatten} whose output only Q "
        "reads (Q acts on every element alike)",
        ("QuantizeLinear",),
        check_q_hoist,
        hoist_q,
    ),
    Q_DQ_LOSSY,
    Rule(
        "dq-sink",
        "M(DQ(x, s, zp)) -> DQ(M(x), s, zp) for any x of an 8- or 16-bit integer type, "
        "per-tensor s and zp, M in {Reshape, Transpose, Squeeze, Unsqueeze, Flatten} the only "
        "reader of DQ's output (DQ acts on every element alike)",
        ("DequantizeLinear",),
        check_dq_sink,
        sink_dq,
    ),
)


class QdqMove(QdqCleanup):
    """``qdq`` plus ``dq-sink`` and ``q-hoist``: data movement done on the quantized tensors.

    Not in the ``default`` preset: onnxruntime matches each quantized op as ``DQ -> op -> Q``
    and drops the pairs around Reshape, Transpose and MaxPool itself. A Reshape moved between a
    MaxPool's Q and the next Gemm's DQ hid both from its QDQ fusions: the digits CNN's int8
    model ran 1.65x slower (0.068 vs 0.041 ms). It suits runtimes that execute QDQ as written.
    """

    name = "qdq-move"
    summary = (
        "qdq, and move per-tensor DQ/Q across data-movement ops (Reshape, Transpose, ...) so "
        "that data moves in the quantized type"
    )
    rules = RULES
