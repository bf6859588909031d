"""Matchers of the Gemm fusions (pass ``fuse-gemm``, :mod:`graphtrim.graph.passes.linear`)."""

from __future__ import annotations

import dataclasses
from typing import Protocol, cast

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import RuleContext, replace


class _Named(Protocol):
    """The pass (``GemmFusion``): its run's name generator."""

    def namer(self, model: ir.Model) -> u.NameGenerator: ...


class _NamedByGraph(Protocol):
    """The pass (``AffineFusion``): its run's name generator for the rule's graph."""

    def namer(self, ctx: RuleContext) -> u.NameGenerator: ...


# element types every runtime's Gemm takes (onnxruntime's CPU Gemm has no float16 kernel)
GEMM_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


def elem_type(value: ir.Value | None) -> ir.DataType | None:
    if value is None:
        return None
    if value.type is not None and isinstance(value.type, ir.TensorType):
        return value.type.dtype
    if value.const_value is not None:
        return value.const_value.dtype
    return None


def last_axis_vector(value: ir.Value | None, n: int, out_rank: int) -> np.ndarray | None:
    """The constant as a length-``n`` float64 vector when it broadcasts along the last axis
    of a rank-``out_rank`` result only (scalar, ``[n]``, ``[1, ..., 1, n]``)."""
    arr = u.const_array(value)
    if arr is None or arr.dtype.kind != "f" or arr.ndim > out_rank:
        return None
    if any(d != 1 for d in arr.shape[:-1]) or (arr.ndim and arr.shape[-1] not in (1, n)):
        return None
    return np.broadcast_to(arr.reshape(-1).astype(np.float64), (n,)).copy()


def is_transpose_2d(node: ir.Node | None) -> bool:
    if not u.is_op(node, "Transpose") or node is None:
        return False
    if u.rank(node.inputs[0]) != 2:
        return False
    perm = node.attributes.get_ints("perm", None)
    return perm is None or list(perm) == [1, 0]


def broadcasts_to(c: ir.Value, y: ir.Value) -> bool:
    """``c`` broadcasts unidirectionally to ``y`` (rank 2) without widening it."""
    cd, yd = u.symbolic_dims(c), u.symbolic_dims(y)
    if cd is None or yd is None or len(yd) != 2 or len(cd) > 2:
        return False
    for cdim, ydim in zip(reversed(cd), reversed(yd), strict=False):
        if cdim == 1:
            continue
        if cdim is None or cdim != ydim:
            return False
    return True


def affine_input(node: ir.Node) -> ir.Value | None:
    """The non-constant operand of an affine map (BatchNormalization in inference mode on a
    rank-2 value, or Mul/Add/Div with one constant operand; Div by the constant only)."""
    if node.op_type == "BatchNormalization":
        if node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
            return None
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return None
        return node.inputs[0] if u.rank(node.inputs[0]) == 2 else None
    if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    a, b = node.inputs
    if u.is_constant(b) and not u.is_constant(a):
        return a
    if node.op_type != "Div" and u.is_constant(a) and not u.is_constant(b):
        return b
    return None


def affine(node: ir.Node, x: ir.Value, n: int) -> tuple[np.ndarray, np.ndarray] | str:
    """``(k, s)`` of the per-column map ``x * k + s`` that ``node`` applies, or why none."""
    if node.op_type == "BatchNormalization":
        params = [u.const_array(v) for v in node.inputs[1:5]]
        if any(p is None or p.size != n or p.dtype.kind != "f" for p in params):
            return "BatchNormalization parameters not constant float vectors of the column count"
        gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)  # type: ignore[union-attr]
        k = gamma / np.sqrt(var + node.attributes.get_float("epsilon", 1e-5))
        return k, beta - mean * k
    other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
    c = last_axis_vector(other, n, 2)
    if c is None:
        return "the constant does not broadcast along the last axis only"
    if node.op_type == "Mul":
        return c, np.zeros(n)
    if node.op_type == "Div":
        if not np.all(c != 0):
            return "a division by zero"
        return 1.0 / c, np.zeros(n)
    return np.ones(n), c


def _namer(ctx: RuleContext) -> u.NameGenerator:
    return cast(_Named, ctx.pass_).namer(ctx.model)


def _tied(weight: ir.Value, reader: ir.Node) -> bool:
    """``weight`` has readers besides ``reader`` (rewriting it would need a copy)."""
    return not all(user is reader for user, _ in weight.uses()) or weight.is_graph_output()


# ---------------------------------------------------------------- affine maps after Gemm


@dataclasses.dataclass
class _AfterGemm:
    x: ir.Value
    gemm: ir.Node
    b: np.ndarray
    scale: np.ndarray
    shift: np.ndarray
    c64: np.ndarray


def check_after_gemm(node: ir.Node, ctx: RuleContext) -> _AfterGemm | str:
    """A per-column ``Y * k + s`` on the output of a Gemm with a constant ``B``."""
    x = affine_input(node)
    gemm = x.producer() if x is not None else None
    if x is None or gemm is None or not u.single_consumer(x):
        return "no computed operand read by this node alone"
    if not u.is_op(gemm, "Gemm"):
        return "the operand is not a Gemm's output"
    b_val = gemm.inputs[1]
    c_val = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    b = u.const_array(b_val)
    if b_val is None or b is None or b.ndim != 2 or b.dtype.kind != "f":
        return "B is not a constant float matrix"
    n = b.shape[0] if gemm.attributes.get_int("transB", 0) else b.shape[1]
    found = affine(node, x, n)
    if isinstance(found, str):
        return found
    scale, shift = found
    if not np.all(scale == 1.0) and _tied(b_val, gemm):
        return "B has other readers (a tied weight)"
    if c_val is None:
        return _AfterGemm(x, gemm, b, scale, shift, np.zeros(n))
    c = u.const_array(c_val)
    if c is None or c.dtype != b.dtype or c.ndim > 2 or c.size not in (1, n):
        return "C is not a constant of B's type broadcasting per column"
    if c.ndim == 2 and c.shape[0] != 1:
        return "C has rows (it would have to be materialized per row)"
    return _AfterGemm(
        x, gemm, b, scale, shift, np.broadcast_to(c.reshape(-1).astype(np.float64), (n,))
    )


def fold_into_gemm(node: ir.Node, m: _AfterGemm, ctx: RuleContext) -> None:
    graph, gemm = ctx.graph, m.gemm
    new_b_val = None
    if not np.all(m.scale == 1.0):
        b_val = gemm.inputs[1]
        assert b_val is not None
        trans_b = gemm.attributes.get_int("transB", 0)
        col = m.scale.reshape(-1, 1) if trans_b else m.scale.reshape(1, -1)
        new_b = (m.b.astype(np.float64) * col).astype(m.b.dtype)
        new_b_val = u.add_initializer(graph, new_b, _namer(ctx)(f"{b_val.name}_fused"))
    beta = gemm.attributes.get_float("beta", 1.0)
    new_c = (beta * m.c64 * m.scale + m.shift).astype(m.b.dtype)
    new_c_val = u.add_initializer(graph, new_c, _namer(ctx)("gemm_bias_fused"))
    if new_b_val is not None:
        gemm.replace_input_with(1, new_b_val)
    if len(gemm.inputs) < 3:
        gemm.resize_inputs(3)
    gemm.replace_input_with(2, new_c_val)
    gemm.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    replace(node.outputs[0], m.x, node.op_type)
    u.remove_nodes(graph, [node])


# ---------------------------------------------------------------- MatMul(A, W) * c


def check_matmul_scale(
    node: ir.Node, ctx: RuleContext
) -> tuple[ir.Value, ir.Node, np.ndarray] | str:
    """``(x, MatMul, k)`` of ``MatMul(A, W) * k`` (or ``/ c``, ``k = 1 / c``) per column."""
    x = affine_input(node)
    mm = x.producer() if x is not None else None
    if x is None or mm is None or not u.is_op(mm, "MatMul") or not u.single_consumer(x):
        return "the operand is not a MatMul's output read by this node alone"
    w_val = mm.inputs[1]
    w = u.const_array(w_val)
    if w_val is None or w is None or w.ndim != 2 or w.dtype.kind != "f":
        return "W is not a constant float matrix"
    if _tied(w_val, mm):
        return "W has other readers (a tied weight)"
    out_rank = u.rank(x)
    if out_rank is None:
        return "the MatMul's rank is unknown"
    other = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
    c = last_axis_vector(other, w.shape[1], out_rank)
    if c is None or (node.op_type == "Div" and not np.all(c != 0)):
        return "the constant does not broadcast along the last axis only (or divides by zero)"
    arr = u.const_array(other)
    if arr is None or arr.dtype != w.dtype:
        return "the constant's type is not W's"
    return x, mm, (1.0 / c if node.op_type == "Div" else c)


def scale_weight(
    node: ir.Node, match: tuple[ir.Value, ir.Node, np.ndarray], ctx: RuleContext
) -> None:
    x, mm, k = match
    w_val = mm.inputs[1]
    w = u.const_array(w_val)
    assert w_val is not None and w is not None
    new_w = (w.astype(np.float64) * k.reshape(1, -1)).astype(w.dtype)
    mm.replace_input_with(
        1, u.add_initializer(ctx.graph, new_w, _namer(ctx)(f"{w_val.name}_fused"))
    )
    replace(node.outputs[0], x, node.op_type)
    u.remove_nodes(ctx.graph, [node])


# ---------------------------------------------------------------- a scalar back into a projection

# ops a scalar factor passes through unchanged (they move or regroup elements, never mix them)
_CARRIERS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


@dataclasses.dataclass
class Projection:
    x: ir.Value  # the scaled operand: the scale's output becomes it
    matmul: ir.Node  # MatMul(A, W), W constant
    bias: ir.Node | None  # an Add of a constant per-column bias on the MatMul's output
    columns: tuple[int, int] | None  # the columns of W (and the bias) that reach x; None: all
    k: np.ndarray  # the factor: shape () or one per column of W


def _factor(node: ir.Node) -> tuple[ir.Value, np.ndarray] | str:
    """``(x, k)`` of ``x * c`` (either order) or ``x / c`` (``k = 1 / c``) with a float constant
    ``c`` of ``x``'s type that broadcasts along the last axis only: ``k`` has shape ``()`` for
    one element, ``(n,)`` for a vector of the last axis."""
    a, b = (node.inputs[0], node.inputs[1]) if len(node.inputs) == 2 else (None, None)
    if a is None or b is None:
        return "not two inputs"
    for x, c in ((a, b),) if node.op_type == "Div" else ((a, b), (b, a)):
        arr = u.const_array(c)
        if arr is None or arr.dtype.kind != "f" or u.is_constant(x):
            continue
        rx = u.rank(x)
        if arr.ndim and (rx is None or arr.ndim > rx or any(d != 1 for d in arr.shape[:-1])):
            continue  # the constant would add dims, or scale more than the last axis
        dtype = elem_type(x)
        if dtype != elem_type(node.outputs[0]) or dtype != ir.DataType.from_numpy(arr.dtype):
            continue
        k = arr.astype(np.float64).reshape(-1) if arr.size > 1 else np.float64(arr.reshape(-1)[0])
        if node.op_type == "Div":
            if np.any(k == 0.0):
                return "a division by zero"
            k = 1.0 / k
        return x, np.asarray(k)
    return "no float constant of the operand's type along its last axis"


def _split_columns(gather: ir.Node, data: ir.Value) -> tuple[ir.Value, tuple[int, int]] | None:
    """``Gather(Reshape(P, s), i, axis)`` where the Reshape splits P's last dim into the dims
    from ``axis`` on and keeps the leading ones, and every reader of the Reshape is such a Gather
    of another index: ``(P, columns of P's last dim that the Gather takes)``."""
    reshape = data.producer()
    idx = u.const_ints(gather.inputs[1]) if len(gather.inputs) == 2 else None
    if reshape is None or not u.is_op(reshape, "Reshape") or idx is None or len(idx) != 1:
        return None
    if u.rank(gather.inputs[1]) != 0:
        return None
    p = reshape.inputs[0]
    shape = u.const_ints(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    p_dims = u.dims(p) if p is not None else None
    if p is None or shape is None or not p_dims or p_dims[-1] is None:
        return None
    axis = gather.attributes.get_int("axis", 0)
    axis = axis + len(shape) if axis < 0 else axis
    tail = shape[axis:]
    if axis != len(p_dims) - 1 or not tail or any(d < 1 for d in tail):
        return None  # the leading dims are P's (copied or read), the rest split its last dim
    if reshape.attributes.get_int("allowzero", 0) or int(np.prod(tail)) != p_dims[-1]:
        return None
    i = idx[0] + tail[0] if idx[0] < 0 else idx[0]
    if not 0 <= i < tail[0]:
        return None
    if not u.single_consumer(p) or data.is_graph_output():
        return None
    for user, _ in data.uses():
        other = u.const_ints(user.inputs[1]) if u.is_op(user, "Gather") else None
        if user is gather:
            continue
        if (
            other is None
            or len(other) != 1
            or user.attributes.get_int("axis", 0) % len(shape) != axis
            or (other[0] + tail[0] if other[0] < 0 else other[0]) == i
        ):
            return None  # a reader of the same columns, or of columns nobody tracks
    width = p_dims[-1] // tail[0]
    return p, (i * width, (i + 1) * width)


def find_projection(x: ir.Value, k: np.ndarray, depth: int = 0) -> Projection | None:
    """The projection ``MatMul(A, W)`` (+ a constant bias) whose output reaches ``x`` through ops
    that carry a scalar factor (layout ops, the unbind of a fused projection into pieces, either
    operand of a MatMul of two computed values), each value on the way read once. A factor per
    column (``k`` a vector) reaches the projection's output directly or through its bias only."""
    per_column = k.ndim == 1
    v, columns, bias = x, None, None
    for _ in range(32):
        node = v.producer()
        if node is None or not u.single_consumer(v):
            return None
        if u.is_op(node, "MatMul") and len(node.inputs) == 2:
            w = node.inputs[1]
            arr = u.const_array(w)
            if w is not None and arr is not None and arr.ndim == 2 and arr.dtype.kind == "f":
                if _tied(w, node) or node.inputs[0] is w:
                    return None  # another reader, or W on both sides of the product
                if columns is not None and not _per_column(bias, arr):
                    return None
                if per_column and (k.shape[0] != arr.shape[1] or not _per_column(bias, arr, 1)):
                    return None
                return Projection(x, node, bias, columns, k)
            if bias is not None or columns is not None or depth > 2 or per_column:
                return None
            for operand in node.inputs:  # the factor goes to either side of the product
                if operand is not None and not u.is_constant(operand):
                    found = find_projection(operand, k, depth + 1)
                    if found is not None:
                        return dataclasses.replace(found, x=x)
            return None
        if u.is_op(node, "Add") and bias is None and len(node.inputs) == 2:
            a, b = node.inputs
            if a is not None and u.is_op(a.producer(), "MatMul") and u.is_constant(b):
                bias, v = node, a
                continue
            if b is not None and u.is_op(b.producer(), "MatMul") and u.is_constant(a):
                bias, v = node, b
                continue
            return None
        if per_column:
            return None
        if node.op_type in _CARRIERS and bias is None and node.inputs[0] is not None:
            v = node.inputs[0]
            continue
        if u.is_op(node, "Gather") and columns is None and bias is None and node.inputs[0]:
            split = _split_columns(node, node.inputs[0])
            if split is None:
                return None
            v, columns = split
            continue
        return None
    return None


def _bias_value(add: ir.Node) -> ir.Value:
    a, b = add.inputs
    assert a is not None and b is not None
    return b if u.is_constant(b) else a


def _per_column(bias: ir.Node | None, w: np.ndarray, rows: int | None = None) -> bool:
    """No bias, or a bias of one value per column of ``w`` (``[N]`` or ``[1, .., 1, N]``); with
    ``rows``, a bias of any rows (a vector factor scales each of them) whose last dim is N."""
    if bias is None:
        return True
    arr = u.const_array(_bias_value(bias))
    if arr is None or arr.shape[-1:] != (w.shape[1],):
        return False
    return rows is not None or arr.size == w.shape[1]


def check_projection_scale(node: ir.Node, ctx: RuleContext) -> Projection | str:
    found = _factor(node)
    if isinstance(found, str):
        return found
    x, k = found
    if not np.all((np.abs(k) > 0.0) & (np.abs(k) <= 1.0)):
        # a factor that shrinks the weights only: a later float16 conversion never meets a
        # weight larger than the model's own (the model computed the product in its own type)
        return "the factor is zero or larger than one in magnitude"
    projection = find_projection(x, k)
    if projection is None:
        return (
            "no projection by a constant weight reaches the operand through single-read layout ops"
        )
    return projection


def scale_projection(node: ir.Node, m: Projection, ctx: RuleContext) -> None:
    w_val = m.matmul.inputs[1]
    w = u.const_array(w_val)
    assert w_val is not None and w is not None
    lo, hi = m.columns if m.columns is not None else (0, w.shape[1])
    new_w = w.astype(np.float64)
    new_w[:, lo:hi] *= m.k
    namer = cast(_NamedByGraph, ctx.pass_).namer(ctx)
    m.matmul.replace_input_with(
        1, u.add_initializer(ctx.graph, new_w.astype(w.dtype), namer(f"{w_val.name}_scaled"))
    )
    if m.bias is not None:
        b_val = _bias_value(m.bias)
        b = u.const_array(b_val)
        assert b is not None
        new_b = b.astype(np.float64).copy()
        if m.columns is None:
            new_b = new_b * m.k
        else:
            new_b.reshape(-1)[lo:hi] *= m.k
        index = list(m.bias.inputs).index(b_val)
        m.bias.replace_input_with(
            index, u.add_initializer(ctx.graph, new_b.astype(b.dtype), namer("bias_scaled"))
        )
    replace(node.outputs[0], m.x, node.op_type)
    u.remove_nodes(ctx.graph, [node])
