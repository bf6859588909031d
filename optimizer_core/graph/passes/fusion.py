"""Affine fusions into Conv, ConvTranspose and BatchNormalization (portable: standard ONNX ops).

With ``k = gamma / sqrt(var + eps)`` per output channel:

- ``BatchNormalization(Conv(x, W, B))`` -> ``Conv(x, W * k, (B - mean) * k + beta)``
- ``Conv(x, W, B) * c`` -> ``Conv(x, W * c, B * c)`` for a per-channel (or scalar) constant ``c``
- ``Conv(x, W, B) + c`` -> ``Conv(x, W, B + c)`` for a per-channel (or scalar) constant ``c``
- the same three for ``ConvTranspose`` (rules ``convtranspose-bn`` / ``-mul`` / ``-add``), whose
  weight is laid out ``[C_in, C_out / group, k...]``: output channel ``o = g * (C_out / group) + j``
  reads ``W[g * C_in / group : (g + 1) * C_in / group, j]``, so that slice is scaled by ``k[o]``
- ``BatchNormalization(x) * c`` -> BN with ``gamma * c``, ``beta * c``;
  ``BatchNormalization(x) + c`` -> BN with ``beta + c`` (per-channel ``c``)

The new constants are computed in float64 and rounded once to the weight's dtype, so results
differ from the unfused model by rounding only (relative error around 1e-7 in float32); the pass
is therefore not in the ``safe`` preset. A fusion happens only when the intermediate value has no
other reader. A weight read by several Convs (or several ConvTransposes of one ``group``) is
rewritten only when all of them apply the same per-channel scale, and they keep sharing the one
rewritten weight (tied weights stay tied, the model never grows by a weight copy); biases and
BatchNormalization vectors within the folding growth budget get a private copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from optimizer_core.graph import _ir_utils as u
from optimizer_core.graph.framework import GraphtrimPass


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


def _rewritable_const(value: ir.Value | None, reader: ir.Node, copy_budget: int) -> bool:
    """A constant that may be replaced by a rewritten copy for ``reader``: read by ``reader``
    alone, or small enough (``copy_budget`` bytes) that a private copy costs nothing worth
    keeping tied weights for."""
    if value is None or not u.is_constant(value) or value.is_graph_output():
        return False
    if all(user is reader for user, _ in value.uses()):
        return True
    return u.const_nbytes(value) <= copy_budget


@dataclasses.dataclass
class _Operand:
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


def _weight_scale(
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


def _operand(value: ir.Value | None) -> _Operand | None:
    if value is None:
        return None
    arr = u.const_array(value)
    if arr is not None:
        return _Operand(tuple(arr.shape), arr.dtype, arr, None, None)
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
    return _Operand(
        tuple(shape), fill_arr.dtype, None, float(fill_arr.reshape(-1)[0]), producer.inputs[0]
    )


class AffineFusion(GraphtrimPass):
    name = "fuse-affine"
    exact = False
    summary = (
        "fold BatchNormalization and per-channel Mul/Add into Conv and ConvTranspose; "
        "Mul/Add into BatchNormalization"
    )

    def apply(self, model: ir.Model) -> bool:
        changed = False
        # rewritten weights by (original weight, reader op, ConvTranspose group, per-channel
        # scale): tied weights stay tied
        self._fused_weights: dict[tuple[int, str, int, bytes], ir.Value] = {}
        for graph in u.all_graphs(model):
            namer: u.NameGenerator | None = None
            for node in u.nodes_in_order(graph):
                if node.graph is None or not u.is_standard(node):
                    continue
                if node.op_type not in ("BatchNormalization", "Mul", "Add"):
                    continue
                x = self._affine_input(node)
                producer = x.producer() if x is not None else None
                if x is None or producer is None or not u.single_consumer(x):
                    continue
                if namer is None:
                    namer = u.NameGenerator(model)
                if u.is_op(producer, "Conv", "ConvTranspose"):
                    done = self._into_conv(node, producer, graph, namer)
                elif (
                    u.is_op(producer, "BatchNormalization") and node.op_type != "BatchNormalization"
                ):
                    done = self._into_bn(node, producer, graph, namer)
                else:
                    continue
                if done:
                    # the rewritten producer now computes this node's output
                    if not u.replace_value(
                        node.outputs[0], x
                    ):  # pragma: no cover - x has a producer
                        raise RuntimeError(f"cannot reroute the output of {node.op_type}")
                    u.remove_nodes(graph, [node])
                    changed = True
        return changed

    @staticmethod
    def _affine_input(node: ir.Node) -> ir.Value | None:
        if node.op_type == "BatchNormalization":
            if node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
                return None
            if "is_test" in node.attributes and not node.attributes.get_int("is_test", 0):
                return None  # opset < 7 in training mode
            if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
                return None
            return node.inputs[0]
        if len(node.inputs) != 2:
            return None
        a, b = node.inputs
        if a is None or b is None:
            return None
        if u.is_constant(b) and not u.is_constant(a):
            return a
        if u.is_constant(a) and not u.is_constant(b):
            return b
        return None

    @staticmethod
    def _other(node: ir.Node, x: ir.Value) -> ir.Value | None:
        return node.inputs[1] if node.inputs[0] is x else node.inputs[0]

    def _bn_scale_shift(self, bn: ir.Node, channels: int) -> tuple[np.ndarray, np.ndarray] | None:
        params = [u.const_array(v) for v in bn.inputs[1:5]]
        if any(p is None or p.size != channels or p.dtype.kind != "f" for p in params):
            return None
        gamma, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)  # type: ignore[union-attr]
        eps = bn.attributes.get_float("epsilon", 1e-5)
        k = gamma / np.sqrt(var + eps)
        return k, beta - mean * k

    def _conv_affine(
        self, node: ir.Node, conv: ir.Node, channels: int, out_rank: int
    ) -> tuple[np.ndarray, np.ndarray, str] | None:
        """(scale, shift, rule) that ``node`` applies per output channel of ``conv`` (a Conv or
        ConvTranspose)."""
        prefix = conv.op_type.lower()
        if node.op_type == "BatchNormalization":
            if self._affine_input(node) is not conv.outputs[0]:
                return None
            ss = self._bn_scale_shift(node, channels)
            return None if ss is None else (ss[0], ss[1], f"{prefix}-bn")
        if node.op_type not in ("Mul", "Add") or self._affine_input(node) is not conv.outputs[0]:
            return None
        c = per_channel(self._other(node, conv.outputs[0]), channels, out_rank)
        if c is None:
            return None
        if node.op_type == "Mul":
            return c, np.zeros(channels), f"{prefix}-mul"
        return np.ones(channels), c, f"{prefix}-add"

    def _tie_agrees(
        self, w_val: ir.Value, conv: ir.Node, scale: np.ndarray, channels: int, out_rank: int
    ) -> bool:
        """Every reader of a shared weight is a node like ``conv`` (same op, and for a
        ConvTranspose the same group, so the weight has the same layout) followed by the same
        per-channel scale, so one rewritten weight serves them all and the tie survives."""
        group = conv.attributes.get_int("group", 1)
        for user, index in w_val.uses():
            if (
                not u.is_op(user, conv.op_type)
                or index != 1
                or not u.single_consumer(user.outputs[0])
            ):
                return False
            if conv.op_type == "ConvTranspose" and user.attributes.get_int("group", 1) != group:
                return False
            follower = next(iter(user.outputs[0].uses()))[0]
            found = self._conv_affine(follower, user, channels, out_rank)
            if found is None or not np.array_equal(found[0], scale):
                return False
        return True

    def _into_conv(
        self, node: ir.Node, conv: ir.Node, graph: ir.Graph, namer: u.NameGenerator
    ) -> bool:
        w_val = conv.inputs[1] if len(conv.inputs) > 1 else None
        b_val = conv.inputs[2] if len(conv.inputs) > 2 else None
        w = _operand(w_val)
        if w_val is None or w is None or w.dtype.kind != "f" or len(w.shape) < 3:
            return False
        group = conv.attributes.get_int("group", 1)
        if conv.op_type == "ConvTranspose":
            if group < 1 or w.shape[0] % group:
                return False
            channels = w.shape[1] * group  # the weight is [C_in, C_out / group, k...]
        else:
            channels = w.shape[0]
        out_rank = len(w.shape)  # the output rank equals the weight rank
        b = (
            _operand(b_val)
            if b_val is not None
            else _Operand((channels,), w.dtype, np.zeros(channels, w.dtype), None, None)
        )
        if b is None or b.shape != (channels,):
            return False
        found = self._conv_affine(node, conv, channels, out_rank)
        if found is None:
            return False
        scale, shift, rule = found
        new_w_val: ir.Value | None = None
        if not np.all(scale == 1.0):
            layout_group = group if conv.op_type == "ConvTranspose" else 1
            key = (id(w_val), conv.op_type, layout_group, scale.tobytes())
            new_w_val = self._fused_weights.get(key)
            if new_w_val is None:
                exclusive = all(user is conv for user, _ in w_val.uses())
                if not exclusive and not self._tie_agrees(w_val, conv, scale, channels, out_rank):
                    return False
                w_scale = _weight_scale(scale, w.shape, conv.op_type, group)
                new_w_val = w.scaled(w_scale, np.zeros(1), graph, conv, namer)
                if new_w_val is None:
                    return False
                self._fused_weights[key] = new_w_val
        # a bias is a vector: a private copy costs C values, less than the node it replaces
        new_b_val = b.scaled(scale, shift, graph, conv, namer)
        if new_b_val is None:
            return False
        if new_w_val is not None:
            conv.replace_input_with(1, new_w_val)
        if len(conv.inputs) < 3:
            conv.resize_inputs(3)
        conv.replace_input_with(2, new_b_val)
        self.hit(rule)
        return True

    def _into_bn(self, node: ir.Node, bn: ir.Node, graph: ir.Graph, namer: u.NameGenerator) -> bool:
        if self._affine_input(bn) is None:
            return False
        gamma_v, beta_v = bn.inputs[1], bn.inputs[2]
        budget = self.options.fold_max_growth_bytes
        if not _rewritable_const(gamma_v, bn, budget) or not _rewritable_const(beta_v, bn, budget):
            return False
        gamma, beta = u.const_array(gamma_v), u.const_array(beta_v)
        if gamma is None or beta is None or gamma.dtype.kind != "f":
            return False
        out_rank = u.rank(bn.outputs[0]) or u.rank(bn.inputs[0])
        if out_rank is None or out_rank < 2:
            return False
        c = per_channel(self._other(node, bn.outputs[0]), gamma.size, out_rank)
        if c is None:
            return False
        g64, b64 = gamma.astype(np.float64).reshape(-1), beta.astype(np.float64).reshape(-1)
        if node.op_type == "Mul":
            g64, b64, rule = g64 * c, b64 * c, "bn-mul"
        else:
            b64, rule = b64 + c, "bn-add"
        assert gamma_v is not None and beta_v is not None
        g_init = u.add_initializer(
            graph, g64.astype(gamma.dtype), namer(f"{gamma_v.name or 'scale'}_fused")
        )
        b_init = u.add_initializer(
            graph, b64.astype(beta.dtype), namer(f"{beta_v.name or 'B'}_fused")
        )
        bn.replace_input_with(1, g_init)
        bn.replace_input_with(2, b_init)
        self.hit(rule)
        return True
