"""A constant permutation of a Conv's input channels is folded into its weight.

``Conv(Gather(x, p, axis=1), W)`` with ``p`` a permutation of ``x``'s channels reads channel
``p[j]`` of ``x`` where the weight has column ``j``; the same Conv on ``x`` itself with
``W'[:, p[j]] = W[:, j]`` computes the same sums over the channels in another order (so results
differ by rounding only: the pass is not in ``safe``). The ``Gather`` goes dead. It is what
``space-to-depth`` leaves before a Conv when a focus block lists its offsets in another order
than ``SpaceToDepth``, and what channel-shuffle exports leave before a plain Conv.

Matched: ``group = 1``, a constant weight read by this Conv alone, a 1-D constant index on axis 1
that is a permutation of ``0 .. C-1`` where ``C`` is ``x``'s static channel count, and a Gather
output read by this Conv alone.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass


def _gather_conv(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, np.ndarray] | str:
    if node.attributes.get_int("group", 1) != 1:
        return "a grouped Conv"
    gather = node.inputs[0].producer() if node.inputs[0] is not None else None
    if gather is None or not u.is_op(gather, "Gather") or gather.attributes.get_int("axis", 0) != 1:
        return "the input is not a Gather on the channels"
    out = gather.outputs[0]
    if out.is_graph_output() or any(user is not node for user, _ in out.uses()):
        return "the Gather has other readers"
    index = u.const_array(gather.inputs[1])
    if index is None or index.ndim != 1:
        return "the Gather's index is not a constant vector"
    channels = (u.dims(gather.inputs[0]) or [None, None])[1]
    if channels != index.size or not np.array_equal(np.sort(index), np.arange(index.size)):
        return "the index is not a permutation of the input's channels"
    weight = node.inputs[1]
    w = u.const_array(weight)
    if w is None or weight is None or any(user is not node for user, _ in weight.uses()):
        return "the weight is not a constant read by this Conv alone"
    if weight.is_graph_output() or w.ndim < 3 or w.shape[1] != index.size:
        return "the weight does not have one column per channel"
    source = gather.inputs[0]
    assert source is not None  # it has a static channel count
    return source, index


def _fold(node: ir.Node, match: tuple[ir.Value, np.ndarray], ctx: RuleContext) -> None:
    x, index = match
    old = node.inputs[1]
    assert old is not None
    w = u.const_array(old)
    assert w is not None
    permuted = np.empty_like(w)
    permuted[:, index] = w
    names = ctx.pass_.names(ctx.model)  # type: ignore[attr-defined]
    new = u.add_initializer(ctx.graph, permuted, names(f"{old.name}_channels"), like=old)
    node.replace_input_with(1, new)
    node.replace_input_with(0, x)


RULES: tuple[Rule, ...] = (
    Rule(
        "gather-conv",
        "Conv(Gather(x, p, axis=1), W) -> Conv(x, W') with W'[:, p[j]] = W[:, j] for a "
        "permutation p of x's channels and group 1 (the channel sum runs in another order)",
        ("Conv",),
        _gather_conv,
        _fold,
    ),
)


class ChannelGatherFusion(RulePass):
    name = "fuse-channel-gather"
    exact = False
    summary = "fold a constant permutation of a Conv's input channels into its weight"
    rules = RULES
