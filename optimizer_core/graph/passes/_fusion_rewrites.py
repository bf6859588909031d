"""The matchers and rewrites of the affine fusions (:mod:`graphtrim.graph.passes.fusion`,
``fuse-affine``): into Conv and ConvTranspose, a scale in front of a Conv, into
BatchNormalization, and parallel Conv branches of one input."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, cast

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._affine import (
    Operand,
    affine_input,
    conv_affine,
    operand,
    other_operand,
    per_channel,
    rewritable_const,
    tie_agrees,
    weight_scale,
)
from graphtrim.graph.passes._parallel_conv import ParallelMatch, check_sum
from graphtrim.graph.rules import RuleContext, replace


class _FusionPass(Protocol):
    """What the rewrites read of the running pass
    (:class:`~graphtrim.graph.passes.fusion.AffineFusion`)."""

    fused_weights: dict[tuple[int, str, int, bytes], ir.Value]

    def namer(self, ctx: RuleContext) -> u.NameGenerator: ...


def _pass(ctx: RuleContext) -> _FusionPass:
    return cast("_FusionPass", ctx.pass_)


def _operand_of(node: ir.Node) -> tuple[ir.Value, ir.Node] | str:
    """The computed operand ``x`` of an affine ``node`` and its producer."""
    x = affine_input(node)
    producer = x.producer() if x is not None else None
    if x is None or producer is None or not u.single_consumer(x):
        return "no computed operand that this node alone reads"
    return x, producer


def _reroute(node: ir.Node, x: ir.Value, ctx: RuleContext) -> None:
    """The rewritten producer of ``x`` now computes ``node``'s output."""
    replace(node.outputs[0], x, node.op_type)
    u.remove_nodes(ctx.graph, [node])


# ---------------------------------------------------------------- into Conv / ConvTranspose


@dataclasses.dataclass
class _IntoConv:
    x: ir.Value
    conv: ir.Node
    w: Operand
    b: Operand
    scale: np.ndarray
    shift: np.ndarray
    # the rewritten weight's cache key and the weight's scale, when the weight changes
    key: tuple[int, str, int, bytes] | None
    w_scale: np.ndarray | None


def _check_conv(node: ir.Node, ctx: RuleContext, op: str) -> _IntoConv | str:
    found = _operand_of(node)
    if isinstance(found, str):
        return found
    x, conv = found
    if not u.is_op(conv, op):
        return f"the operand is not a {op}'s output"
    w_val = conv.inputs[1] if len(conv.inputs) > 1 else None
    b_val = conv.inputs[2] if len(conv.inputs) > 2 else None
    w = operand(w_val)
    if w_val is None or w is None or w.dtype.kind != "f" or len(w.shape) < 3:
        return "the weight is not a constant float tensor"
    group = conv.attributes.get_int("group", 1)
    if op == "ConvTranspose":
        if group < 1 or w.shape[0] % group:
            return "the group does not divide the input channels"
        channels = w.shape[1] * group  # the weight is [C_in, C_out / group, k...]
    else:
        channels = w.shape[0]
    out_rank = len(w.shape)  # the output rank equals the weight rank
    b = (
        operand(b_val)
        if b_val is not None
        else Operand((channels,), w.dtype, np.zeros(channels, w.dtype), None, None)
    )
    if b is None or b.shape != (channels,):
        return "the bias is not a constant vector of the output channels"
    affine = conv_affine(node, conv, channels, out_rank)
    if affine is None:
        return "not a per-channel constant or an inference-mode BatchNormalization"
    scale, shift, _ = affine
    key = w_scale = None
    if not np.all(scale == 1.0):
        layout_group = group if op == "ConvTranspose" else 1
        key = (id(w_val), op, layout_group, scale.tobytes())
        w_scale = weight_scale(scale, w.shape, op, group)
        if key not in _pass(ctx).fused_weights:
            exclusive = all(user is conv for user, _ in w_val.uses())
            if not exclusive and not tie_agrees(w_val, conv, scale, channels, out_rank):
                return "the weight is shared with readers scaled differently"
            if not w.can_scale(w_scale, np.zeros(1)):
                return "a uniform-fill weight under a per-channel scale would grow the model"
    # a bias is a vector: a private copy costs C values, less than the node it replaces
    if not b.can_scale(scale, shift):
        return "a uniform-fill bias under a per-channel map would grow the model"
    return _IntoConv(x, conv, w, b, scale, shift, key, w_scale)


def check_into_conv(node: ir.Node, ctx: RuleContext) -> _IntoConv | str:
    return _check_conv(node, ctx, "Conv")


def check_into_conv_transpose(node: ir.Node, ctx: RuleContext) -> _IntoConv | str:
    return _check_conv(node, ctx, "ConvTranspose")


def fold_into_conv(node: ir.Node, m: _IntoConv, ctx: RuleContext) -> None:
    fusion, graph, conv = _pass(ctx), ctx.graph, m.conv
    namer = fusion.namer(ctx)
    new_w_val: ir.Value | None = None
    if m.key is not None:
        new_w_val = fusion.fused_weights.get(m.key)
        if new_w_val is None:
            assert m.w_scale is not None
            new_w_val = m.w.scaled(m.w_scale, np.zeros(1), graph, conv, namer)
            assert new_w_val is not None  # checked by can_scale
            fusion.fused_weights[m.key] = new_w_val
    new_b_val = m.b.scaled(m.scale, m.shift, graph, conv, namer)
    assert new_b_val is not None  # checked by can_scale
    if new_w_val is not None:
        conv.replace_input_with(1, new_w_val)
    if len(conv.inputs) < 3:
        conv.resize_inputs(3)
    conv.replace_input_with(2, new_b_val)
    _reroute(node, m.x, ctx)


# ---------------------------------------------------------------- a scale in front of a Conv


@dataclasses.dataclass
class _ScaledInput:
    x: ir.Value
    w: Operand
    w_scale: np.ndarray
    key: tuple[int, str, int, bytes]


def _input_scale(conv: ir.Node, w: Operand) -> tuple[ir.Value, np.ndarray] | str:
    """``(x, c)`` of a Conv reading ``Mul(x, c)`` (read by it alone) for a finite scalar or
    per-input-channel constant ``c`` of the weight's type and rank."""
    scaled = conv.inputs[0]
    mul = scaled.producer() if scaled is not None else None
    if scaled is None or mul is None or not u.is_op(mul, "Mul") or not u.single_consumer(scaled):
        return "the input is not a product that this Conv alone reads"
    x = affine_input(mul)
    if x is None:
        return "the product is not of a computed tensor and a constant"
    if _completes_gelu(x):
        return "the scale is the 0.5 of a Gelu (x * (1 + erf(x / sqrt 2)) * 0.5): onnxruntime fuses it as it stands"
    const = other_operand(mul, x)
    arr = u.const_array(const)
    if arr is None or arr.dtype != w.dtype:
        return "the constant and the weight differ in type"
    group = conv.attributes.get_int("group", 1)
    c = per_channel(const, w.shape[1] * group, len(w.shape))
    if c is None or not np.all(np.isfinite(c)):
        return "the constant is not a finite scalar or per-input-channel vector"
    return x, c


def _completes_gelu(x: ir.Value) -> bool:
    """Whether ``x`` is ``a * (1 + Erf(..))`` or ``a * (1 + Tanh(..))``: the rest of a Gelu
    whose last factor is the scale (TorchScript's order)."""
    prod = x.producer()
    if prod is None or not u.is_op(prod, "Mul"):
        return False
    for v in prod.inputs:
        add = v.producer() if v is not None else None
        if add is not None and u.is_op(add, "Add"):
            for w in add.inputs:
                act = w.producer() if w is not None else None
                if act is not None and (u.is_op(act, "Erf") or u.is_op(act, "Tanh")):
                    return True
    return False


def check_scaled_input(node: ir.Node, ctx: RuleContext) -> _ScaledInput | str:
    """``Conv(Mul(x, c), W, B)``: ``c`` a scalar or per-input-channel constant, the product read
    by this Conv alone, the weight a constant float tensor that every reader scales alike."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return "no input or weight"
    w_val = node.inputs[1]
    w = operand(w_val)
    if w is None or w.dtype.kind != "f" or len(w.shape) < 3 or w_val.is_graph_output():
        return "the weight is not a constant float tensor"
    found = _input_scale(node, w)
    if isinstance(found, str):
        return found
    x, c = found
    group = node.attributes.get_int("group", 1)
    c_out, c_in_g = w.shape[0], w.shape[1]
    if group < 1 or c_out % group:
        return "the group does not divide the output channels"
    key = (id(w_val), "mul-conv", group, c.tobytes())
    if key not in _pass(ctx).fused_weights:
        # a weight shared by several Convs is rewritten once, for all, when each reads its
        # input through the same scale (tied weights stay tied)
        for user, index in w_val.uses():
            if user is node:
                continue
            if index != 1 or not u.is_op(user, "Conv"):
                return "the weight has readers other than Convs"
            if user.attributes.get_int("group", 1) != group:
                return "the weight is shared by Convs of another group"
            other = _input_scale(user, w)
            if isinstance(other, str) or not np.array_equal(other[1], c):
                return "the weight is shared with readers scaled differently"
    groups = np.arange(c_out) // (c_out // group)
    matrix = c[groups[:, None] * c_in_g + np.arange(c_in_g)[None, :]]
    w_scale = matrix.reshape((c_out, c_in_g) + (1,) * (len(w.shape) - 2))
    if not w.can_scale(w_scale, np.zeros(1)):
        return "a uniform-fill weight under a per-channel scale would grow the model"
    return _ScaledInput(x, w, w_scale, key)


def fold_scaled_input(node: ir.Node, m: _ScaledInput, ctx: RuleContext) -> None:
    fusion = _pass(ctx)
    new_w = fusion.fused_weights.get(m.key)
    if new_w is None:
        new_w = m.w.scaled(m.w_scale, np.zeros(1), ctx.graph, node, fusion.namer(ctx))
        assert new_w is not None  # checked by can_scale
        fusion.fused_weights[m.key] = new_w
    node.replace_input_with(1, new_w)
    node.replace_input_with(0, m.x)


# ---------------------------------------------------------------- into BatchNormalization


def check_into_bn(node: ir.Node, ctx: RuleContext) -> tuple[ir.Value, ir.Node, np.ndarray] | str:
    """``(x, bn, c)`` of ``BatchNormalization(...) * c`` or ``+ c`` per channel."""
    found = _operand_of(node)
    if isinstance(found, str):
        return found
    x, bn = found
    if not u.is_op(bn, "BatchNormalization"):
        return "the operand is not a BatchNormalization's output"
    if affine_input(bn) is None:
        return "not an inference-mode BatchNormalization"
    gamma_v, beta_v = bn.inputs[1], bn.inputs[2]
    budget = ctx.options.fold_max_growth_bytes
    if not rewritable_const(gamma_v, bn, budget) or not rewritable_const(beta_v, bn, budget):
        return "scale or B is shared and larger than the growth budget"
    gamma, beta = u.const_array(gamma_v), u.const_array(beta_v)
    if gamma is None or beta is None or gamma.dtype.kind != "f":
        return "scale or B is not a float constant"
    out_rank = u.rank(bn.outputs[0]) or u.rank(bn.inputs[0])
    if out_rank is None or out_rank < 2:
        return "the rank is unknown or below 2"
    c = per_channel(other_operand(node, bn.outputs[0]), gamma.size, out_rank)
    if c is None:
        return "the constant is not per channel"
    return x, bn, c


def fold_into_bn(node: ir.Node, m: tuple[ir.Value, ir.Node, np.ndarray], ctx: RuleContext) -> None:
    x, bn, c = m
    gamma_v, beta_v = bn.inputs[1], bn.inputs[2]
    gamma, beta = u.const_array(gamma_v), u.const_array(beta_v)
    assert gamma_v is not None and beta_v is not None and gamma is not None and beta is not None
    g64, b64 = gamma.astype(np.float64).reshape(-1), beta.astype(np.float64).reshape(-1)
    if node.op_type == "Mul":
        g64, b64 = g64 * c, b64 * c
    else:
        b64 = b64 + c
    namer = _pass(ctx).namer(ctx)
    g_init = u.add_initializer(
        ctx.graph, g64.astype(gamma.dtype), namer(f"{gamma_v.name or 'scale'}_fused")
    )
    b_init = u.add_initializer(
        ctx.graph, b64.astype(beta.dtype), namer(f"{beta_v.name or 'B'}_fused")
    )
    bn.replace_input_with(1, g_init)
    bn.replace_input_with(2, b_init)
    _reroute(node, x, ctx)


# ---------------------------------------------------------------- parallel branches of one input


def _sum_check(kind: str) -> Callable[[ir.Node, RuleContext], ParallelMatch | str]:
    def check(node: ir.Node, ctx: RuleContext) -> ParallelMatch | str:
        return check_sum(node, kind)

    return check


def fold_parallel(node: ir.Node, m: ParallelMatch, ctx: RuleContext) -> None:
    """The host Conv takes the merged weight and bias and computes the sum; the other branch
    goes."""
    host = m.host.node
    namer = _pass(ctx).namer(ctx)
    w_val = host.inputs[1]
    assert w_val is not None
    new_w = u.add_initializer(
        ctx.graph, m.w.astype(m.host.w.dtype), namer(f"{w_val.name or 'W'}_merged")
    )
    host.replace_input_with(1, new_w)
    if m.b is not None:
        if len(host.inputs) < 3:
            host.resize_inputs(3)
        new_b = u.add_initializer(
            ctx.graph, m.b.astype(m.host.w.dtype), namer(f"{host.name or 'conv'}_bias_merged")
        )
        host.replace_input_with(2, new_b)
    _reroute(node, host.outputs[0], ctx)
    if m.other is not None:
        u.remove_nodes(ctx.graph, [m.other])
