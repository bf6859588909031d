"""Matchers of the affine fusions (pass ``fuse-affine``, :mod:`graphtrim.graph.passes.fusion`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u


def per_channel(value: ir.Value | None, channels: int, out_rank: int) -> np.ndarray | None:
    """The constant as a length-``channels`` vector if it broadcasts along axis 1 only."""
    arr = u.const_array(value)
    if arr is None or arr.dtype.kind != "f" or arr.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - arr.ndim) + arr.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    if shape[1] not in (1, channels):
        return None
    return np.broadcast_to(arr.reshape(-1).astype(np.float64), (channels,)).copy()


def rewritable_const(value: ir.Value | None, reader: ir.Node, copy_budget: int) -> bool:
    """A constant that may be replaced by a rewritten copy for ``reader``: read by ``reader``
    alone, or small enough (``copy_budget`` bytes) that a private copy costs nothing worth
    keeping tied weights for."""
    if value is None or not u.is_constant(value) or value.is_graph_output():
        return False
    if all(user is reader for user, _ in value.uses()):
        return True
    return u.const_nbytes(value) <= copy_budget


@dataclasses.dataclass
class Operand:
    """A constant operand of a fusion: a materialized array, or a uniform fill produced by
    ``ConstantOfShape`` (kept as a fill so the model does not grow)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    array: np.ndarray | None
    fill: float | None
    shape_input: ir.Value | None

    def _broadcastable(self, arr: np.ndarray) -> np.ndarray:
        if arr.ndim == 1 and len(self.shape) > 1:
            return arr.reshape((-1,) + (1,) * (len(self.shape) - 1))
        return arr

    def can_scale(self, scale: np.ndarray, shift: np.ndarray) -> bool:
        """:meth:`scaled` returns a value (a fill stays a fill only under a uniform map)."""
        if self.array is not None:
            return True
        scale, shift = self._broadcastable(scale), self._broadcastable(shift)
        s0, t0 = float(scale.reshape(-1)[0]), float(shift.reshape(-1)[0])
        return self.fill is not None and bool(np.all(scale == s0) and np.all(shift == t0))

    def scaled(
        self,
        scale: np.ndarray,
        shift: np.ndarray,
        graph: ir.Graph,
        before: ir.Node,
        namer: u.NameGenerator,
    ) -> ir.Value | None:
        """``self * scale + shift`` as a new initializer or fill: vectors apply along axis 0,
        higher-rank arrays broadcast against the operand's shape."""
        scale, shift = self._broadcastable(scale), self._broadcastable(shift)
        if self.array is not None:
            out = self.array.astype(np.float64) * scale + shift
            return u.add_initializer(graph, out.astype(self.dtype), namer("fused"))
        s0, t0 = float(scale.reshape(-1)[0]), float(shift.reshape(-1)[0])
        if self.fill is None or not (np.all(scale == s0) and np.all(shift == t0)):
            return None  # a per-channel result would have to be materialized: the model would grow
        value = np.array([self.fill * s0 + t0], dtype=self.dtype)
        node = ir.Node(
            "", "ConstantOfShape", [self.shape_input], [ir.AttrTensor("value", ir.Tensor(value))]
        )
        graph.insert_before(before, node)
        out = node.outputs[0]
        # typed here, so no shape inference has to run for it
        out.shape = ir.Shape(self.shape)
        out.type = ir.TensorType(ir.DataType.from_numpy(value.dtype))
        return out


def weight_scale(
    scale: np.ndarray, w_shape: tuple[int, ...], op_type: str, group: int
) -> np.ndarray:
    """The per-output-channel ``scale`` shaped to multiply the weight of ``op_type``.

    A Conv weight is ``[C_out, C_in / group, k...]``: the scale runs along axis 0. A ConvTranspose
    weight is ``[C_in, C_out / group, k...]``: output channel ``g * (C_out / group) + j`` is
    ``W[g * C_in / group : (g + 1) * C_in / group, j]``.
    """
    tail = (1,) * (len(w_shape) - 2)
    if op_type == "Conv":
        return scale.reshape((-1, 1, *tail))
    c_in, c_out_g = w_shape[0], w_shape[1]
    per_group = scale.reshape(group, 1, c_out_g)
    full = np.broadcast_to(per_group, (group, c_in // group, c_out_g))
    return full.reshape((c_in, c_out_g, *tail))


def operand(value: ir.Value | None) -> Operand | None:
    if value is None:
        return None
    arr = u.const_array(value)
    if arr is not None:
        return Operand(tuple(arr.shape), arr.dtype, arr, None, None)
    producer = value.producer()
    if producer is None or not u.is_op(producer, "ConstantOfShape") or producer.inputs[0] is None:
        return None
    shape = u.const_ints(producer.inputs[0])
    if shape is None:
        return None
    if "value" in producer.attributes:
        fill_arr = producer.attributes["value"].value.numpy()
    else:
        fill_arr = np.zeros(1, dtype=np.float32)
    if fill_arr.size != 1:
        return None
    return Operand(
        tuple(shape), fill_arr.dtype, None, float(fill_arr.reshape(-1)[0]), producer.inputs[0]
    )


def affine_input(node: ir.Node) -> ir.Value | None:
    if node.op_type == "BatchNormalization":
        if node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
            return None
        if "is_test" in node.attributes and not node.attributes.get_int("is_test", 0):
            return None  # opset < 7 in training mode
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return None
        return node.inputs[0]
    found = one_constant(node)
    return found[0] if found is not None else None


def one_constant(node: ir.Node) -> tuple[ir.Value, ir.Value, int] | None:
    """(variable operand, constant operand, the variable's input index) of a binary node with
    exactly one constant input; None for any other node."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is None or b is None:
        return None
    if u.is_constant(b) and not u.is_constant(a):
        return a, b, 0
    if u.is_constant(a) and not u.is_constant(b):
        return b, a, 1
    return None


def other_operand(node: ir.Node, x: ir.Value) -> ir.Value | None:
    return node.inputs[1] if node.inputs[0] is x else node.inputs[0]


def bn_scale_shift(bn: ir.Node, channels: int) -> tuple[np.ndarray, np.ndarray] | None:
    params = [u.const_array(v) for v in bn.inputs[1:5]]
    if any(p is None or p.size != channels or p.dtype.kind != "f" for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)  # type: ignore[union-attr]
    eps = bn.attributes.get_float("epsilon", 1e-5)
    k = gamma / np.sqrt(var + eps)
    return k, beta - mean * k


def conv_affine(
    node: ir.Node, conv: ir.Node, channels: int, out_rank: int
) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(scale, shift, rule) that ``node`` applies per output channel of ``conv`` (a Conv or
    ConvTranspose)."""
    prefix = conv.op_type.lower()
    if node.op_type == "BatchNormalization":
        if affine_input(node) is not conv.outputs[0]:
            return None
        ss = bn_scale_shift(node, channels)
        return None if ss is None else (ss[0], ss[1], f"{prefix}-bn")
    if node.op_type not in ("Mul", "Add") or affine_input(node) is not conv.outputs[0]:
        return None
    c = per_channel(other_operand(node, conv.outputs[0]), channels, out_rank)
    if c is None:
        return None
    if node.op_type == "Mul":
        return c, np.zeros(channels), f"{prefix}-mul"
    return np.ones(channels), c, f"{prefix}-add"


def tie_agrees(
    w_val: ir.Value, conv: ir.Node, scale: np.ndarray, channels: int, out_rank: int
) -> bool:
    """Every reader of a shared weight is a node like ``conv`` (same op, and for a
    ConvTranspose the same group, so the weight has the same layout) followed by the same
    per-channel scale, so one rewritten weight serves them all and the tie survives."""
    group = conv.attributes.get_int("group", 1)
    for user, index in w_val.uses():
        if not u.is_op(user, conv.op_type) or index != 1 or not u.single_consumer(user.outputs[0]):
            return False
        if conv.op_type == "ConvTranspose" and user.attributes.get_int("group", 1) != group:
            return False
        follower = next(iter(user.outputs[0].uses()))[0]
        found = conv_affine(follower, user, channels, out_rank)
        if found is None or not np.array_equal(found[0], scale):
            return False
    return True
