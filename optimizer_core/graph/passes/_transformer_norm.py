"""The normalization fusions of pass ``fuse-transformer``: LayerNormalization (opset 17) and
RMSNormalization (opset 23), matched from the ReduceMean of the squares."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._transformer_common import (
    FLOATS,
    elem_type,
    fusion,
    producer,
    scalar,
    sole_reader,
    split_const,
)
from graphtrim.graph.rules import RuleContext, replace
from graphtrim.graph.targets import emits_allowed


def _last_axis_mean(node: ir.Node, x: ir.Value | None) -> bool:
    """``node`` is ReduceMean over the last axis of ``x`` with keepdims."""
    if node.attributes.get_int("keepdims", 1) != 1 or x is None:
        return False
    # none given, or not constant: [] names no axis
    axes = u.ints_given(node, "axes", 1) or []
    if axes == [-1]:
        return True  # the last axis whatever the rank
    r = u.rank(x)
    return r is not None and len(axes) == 1 and axes[0] == r - 1


def square_of(value: ir.Value | None) -> tuple[ir.Value, ir.Node] | None:
    """``(x, node)`` when ``value`` is ``x * x`` or ``x ** 2``."""
    node = producer(value, "Mul", "Pow")
    if node is None or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if node.op_type == "Mul":
        return (a, node) if a is not None and a is b else None
    return (a, node) if a is not None and scalar(b) == 2.0 else None


def _channel_const(node: ir.Node, y: ir.Value, channels: int, dtype: np.dtype) -> ir.Value | None:
    other = node.inputs[1] if node.inputs[0] is y else node.inputs[0]
    arr = u.const_array(other)
    if other is None or arr is None or arr.dtype != dtype:
        return None
    return other if arr.shape == (channels,) else None


@dataclasses.dataclass
class Norm:
    kind: str  # "layernorm" or "rmsnorm"
    x: ir.Value
    eps: float
    channels: int
    dtype: np.dtype
    y: ir.Value  # the value the fused op computes
    last: ir.Node  # the pattern's last node (the fused op goes before it)
    gamma: ir.Value | None
    beta: ir.Value | None
    nodes: tuple[ir.Node, ...]  # the pattern's nodes, the affine tail included


def match_norm(mean2: ir.Node, ctx: RuleContext) -> Norm | str:
    """Match from the ReduceMean of the squares (the variance, or the mean square): a
    decomposed normalization the model's opset and the target have the fused op for."""
    found = match_decomposed(mean2)
    if isinstance(found, Norm) and found.kind == "rmsnorm":
        if fusion(ctx).opset < 23 or not emits_allowed(ctx.options.target, "RMSNormalization"):
            return "RMSNormalization needs opset 23 and a target that takes it"
    return found


def match_decomposed(mean2: ir.Node) -> Norm | str:
    """A decomposed LayerNormalization or RMSNormalization (on any opset), matched from the
    ReduceMean of the squares."""
    sq = square_of(mean2.inputs[0])
    if sq is None:
        return "the input is not a square"
    d, sq_node = sq
    if not _last_axis_mean(mean2, d) or elem_type(d) not in FLOATS:
        return "not a float mean over the last axis with keepdims"
    # Add(eps) -> Sqrt -> Div(d, .) or Mul(d, Reciprocal(.))
    v = mean2.outputs[0]
    if len(v.uses()) != 1:
        return "the mean has several readers"
    add = next(iter(v.uses()))[0]
    split = split_const(add) if u.is_op(add, "Add") else None
    eps = scalar(split[1]) if split is not None else None
    if split is None or eps is None or eps < 0 or len(add.outputs[0].uses()) != 1:
        return "not followed by + eps (a scalar >= 0) read once"
    sqrt = next(iter(add.outputs[0].uses()))[0]
    if not u.is_op(sqrt, "Sqrt") or len(sqrt.outputs[0].uses()) != 1:
        return "not followed by a Sqrt read once"
    nxt = next(iter(sqrt.outputs[0].uses()))[0]
    chain = [mean2, add, sqrt]
    if u.is_op(nxt, "Div") and nxt.inputs[0] is d and nxt.inputs[1] is sqrt.outputs[0]:
        scaled = nxt
    elif u.is_op(nxt, "Reciprocal") and len(nxt.outputs[0].uses()) == 1:
        recip_reader = next(iter(nxt.outputs[0].uses()))[0]
        if not u.is_op(recip_reader, "Mul") or d not in recip_reader.inputs:
            return "the reciprocal does not multiply the normalized value"
        chain.append(nxt)
        scaled = recip_reader
    else:
        return "the root does not divide the normalized value"
    chain += [sq_node, scaled]
    # centered (LayerNormalization) or not (RMSNormalization)
    sub = producer(d, "Sub")
    mean1 = producer(sub.inputs[1], "ReduceMean") if sub is not None else None
    if (
        sub is not None
        and mean1 is not None
        and sub.inputs[0] is mean1.inputs[0]
        and _last_axis_mean(mean1, sub.inputs[0])
        and len(mean1.outputs[0].uses()) == 1
    ):
        x = sub.inputs[0]
        kind = "layernorm"
        chain += [sub, mean1]
        inner = {id(n) for n in chain}
        if any(id(user) not in inner for user, _ in d.uses()) or d.is_graph_output():
            return "the centered value is read outside the pattern"
    else:
        x, kind = d, "rmsnorm"
    inner = {id(n) for n in chain}
    for n in chain:
        if n is scaled:
            continue
        for out in n.outputs:
            if out.is_graph_output() or any(id(user) not in inner for user, _ in out.uses()):
                return "an intermediate value is read outside the pattern"
    assert x is not None
    channels = u.last_dim(x)
    if channels is None:
        return "the last dim is not static"
    dtype = elem_type(x)
    assert dtype is not None
    np_dtype = dtype.numpy()
    # optional affine tail: * gamma, + beta (per-channel constants of x's dtype)
    y = scaled.outputs[0]
    tail: list[ir.Node] = []

    def affine(op: str) -> ir.Value | None:
        """The per-channel constant of ``op`` reading ``y`` alone, which then moves past it."""
        nonlocal y
        node = sole_reader(y, op)
        found = _channel_const(node, y, channels, np_dtype) if node is not None else None
        if node is not None and found is not None:
            y = node.outputs[0]
            tail.append(node)
        return found

    gamma = affine("Mul")
    beta = affine("Add") if kind == "layernorm" else None
    last = tail[-1] if tail else scaled
    return Norm(kind, x, eps, channels, np_dtype, y, last, gamma, beta, (*chain, *tail))


# the opset from which each normalization is one ONNX op
NORM_OPSET = {"layernorm": 17, "rmsnorm": 23}


def runtime_fused_scale(x: ir.Value, scale: ir.Value, opset: int) -> bool:
    """``x * scale`` is the scale of a written-out normalization that onnxruntime fuses into one
    kernel when it loads the model: the square is a ``Pow``, the root divides, and the model's
    opset has no op for it. onnxruntime's fusions (LayerNormalization, and the
    SimplifiedLayerNormalization of the mean of squares) end at that ``Mul``: without it the
    pattern runs op by op, even where the scale is all ones."""
    return _scaled_norm(x, scale, opset) is not None


def _scaled_norm(x: ir.Value, scale: ir.Value, opset: int) -> str | None:
    """The kind of the normalization :func:`runtime_fused_scale` finds (``"layernorm"`` or
    ``"rmsnorm"``), or ``None``."""
    div = producer(x, "Div")
    sqrt = producer(div.inputs[1], "Sqrt") if div is not None and len(div.inputs) == 2 else None
    add = producer(sqrt.inputs[0], "Add") if sqrt is not None else None
    if add is None:
        return None
    for operand in add.inputs:
        mean2 = producer(operand, "ReduceMean")
        if mean2 is None:
            continue
        norm = match_decomposed(mean2)
        square = square_of(mean2.inputs[0])
        fused = (
            isinstance(norm, Norm)
            and norm.gamma is scale
            and square is not None
            and square[1].op_type == "Pow"
            and opset < NORM_OPSET[norm.kind]
        )
        return norm.kind if fused and isinstance(norm, Norm) else None
    return None


def fused_scales(model: ir.Model) -> list[tuple[ir.Node, ir.Value]]:
    """The ``Mul`` nodes by all ones that ``algebraic`` keeps as the scale of a written-out
    normalization (:func:`runtime_fused_scale`), each with the value it scales."""
    found = []
    for graph in u.all_graphs(model):
        for node in graph:
            if not u.is_op(node, "Mul") or len(node.inputs) != 2:
                continue
            for k in (0, 1):
                x, c = node.inputs[1 - k], node.inputs[k]
                if x is None or c is None or not u.is_all(c, 1):
                    continue
                if runtime_fused_scale(x, c, u.node_opset(node, model)):
                    found.append((node, x))
                    break
    return found


def drop_scales(model: ir.Model) -> int:
    """Remove the scales :func:`fused_scales` finds (they multiply by one), and their constants
    where nothing else reads them; the count removed."""
    dropped = 0
    for node, x in fused_scales(model):
        graph = node.graph
        ones = next(v for v in node.inputs if v is not x)
        if graph is None or ones is None or not u.replace_value(node.outputs[0], x):
            continue
        graph.remove(node, safe=True)
        dropped += 1
        if ones.is_initializer() and not ones.uses() and not ones.is_graph_input():
            graph.initializers.pop(ones.name or "")
    return dropped


def add_zero_shifts(model: ir.Model) -> int:
    """Give each centered normalization whose scale :func:`fused_scales` finds a shift of zeros
    after it, where nothing shifts its output yet: onnxruntime's LayerNormFusion ends at the
    shift's ``Add``, and fuses the pattern whole (one kernel) only with it; without it, the
    centering stays two kernels beside SimplifiedLayerNormalization. The count added."""
    added = 0
    namer: u.NameGenerator | None = None
    for node, x in fused_scales(model):
        graph, out = node.graph, node.outputs[0]
        scale = next(v for v in node.inputs if v is not x)
        if graph is None or scale is None or scale.dtype is None:
            continue
        shape = u.static_shape(scale)
        if shape is None:
            continue
        if _scaled_norm(x, scale, u.node_opset(node, model)) != "layernorm":
            continue  # the mean of squares has no shift: its fusion ends at the scale
        users = list(out.uses())
        if any(
            u.is_op(user, "Add") and u.const_array(user.inputs[1 - idx]) is not None
            for user, idx in users
            if len(user.inputs) == 2
        ):
            continue  # already shifted
        namer = namer or u.NameGenerator(model)
        zeros = np.zeros(shape, dtype=scale.dtype.numpy())
        shift = u.add_initializer(graph, zeros, namer(f"{scale.name or 'scale'}_zero_shift"))
        add = ir.Node("", "Add", [out, shift], name=namer(f"{node.name or 'Mul'}_shift"))
        graph.insert_after(node, add)
        shifted = add.outputs[0]
        shifted.type, shifted.shape = out.type, out.shape
        shifted.name = namer(f"{out.name or 'scaled'}_shifted")
        for user, idx in users:
            user.replace_input_with(idx, shifted)
        if out.is_graph_output():
            i = next(k for k, v in enumerate(graph.outputs) if v is out)
            name = out.name
            out.name = namer(f"{name}_scaled")
            shifted.name = name
            graph.outputs[i] = shifted
        added += 1
    return added


def check_layernorm(node: ir.Node, ctx: RuleContext) -> Norm | str:
    found = match_norm(node, ctx)
    if isinstance(found, Norm) and found.kind != "layernorm":
        return "not centered (an RMSNormalization pattern)"
    return found


def check_rmsnorm(node: ir.Node, ctx: RuleContext) -> Norm | str:
    found = match_norm(node, ctx)
    if isinstance(found, Norm) and found.kind != "rmsnorm":
        return "centered (a LayerNormalization pattern)"
    return found


def fuse_norm(node: ir.Node, m: Norm, ctx: RuleContext) -> None:
    name = fusion(ctx).new_name
    gamma = m.gamma
    if gamma is None:
        gamma = u.add_initializer(ctx.graph, np.ones(m.channels, m.dtype), name("norm_scale"))
    inputs = [m.x, gamma] + ([m.beta] if m.beta is not None else [])
    op = "LayerNormalization" if m.kind == "layernorm" else "RMSNormalization"
    fused = ir.Node(
        "",
        op,
        inputs,
        [ir.AttrInt64("axis", -1), ir.AttrFloat32("epsilon", m.eps)],
        name=name(op),
        version=None,
    )
    ctx.graph.insert_before(m.last, fused)
    fused.outputs[0].shape = m.y.shape
    fused.outputs[0].type = m.y.type
    replace(m.y, fused.outputs[0], op)
