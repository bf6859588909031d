"""Exact numpy evaluation of the ops that dominate constant subgraphs: data movement, fills and
integer shape arithmetic.

Creating an onnxruntime session costs tens of milliseconds; most folded subgraphs (shape
arithmetic, ``ConstantOfShape`` fills, ``Unsqueeze``/``Concat`` of shape vectors) need none. Only
ops whose numpy result is bit-identical to onnxruntime's are here: data movement for any dtype,
fills, and wrap-around integer ``Add``/``Sub``/``Mul``. Anything else returns ``None`` and the
caller uses onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u

Arrays = Sequence[np.ndarray | None]


def _axes(node: ir.Node, inputs: Arrays, index: int) -> list[int] | None:
    if "axes" in node.attributes:
        return list(node.attributes["axes"].as_ints())
    if len(inputs) > index and inputs[index] is not None:
        return [int(a) for a in np.asarray(inputs[index]).reshape(-1)]
    return None


def _unsqueeze(node: ir.Node, x: Arrays) -> np.ndarray | None:
    axes = _axes(node, x, 1)
    if axes is None or x[0] is None:
        return None
    rank = x[0].ndim + len(axes)
    norm = u.normalize_axes(axes, rank)
    if norm is None or len(set(norm)) != len(norm):
        return None
    out = x[0]
    for a in sorted(norm):
        out = np.expand_dims(out, a)
    return out


def _squeeze(node: ir.Node, x: Arrays) -> np.ndarray | None:
    if x[0] is None:
        return None
    axes = _axes(node, x, 1)
    if axes is None:
        return np.squeeze(x[0])
    norm = u.normalize_axes(axes, x[0].ndim)
    if norm is None or any(x[0].shape[a] != 1 for a in norm):
        return None
    return np.squeeze(x[0], axis=tuple(norm))


def _reshape(node: ir.Node, x: Arrays) -> np.ndarray | None:
    data, shape = x[0], x[1]
    if data is None or shape is None:
        return None
    target = [int(s) for s in shape.reshape(-1)]
    if not node.attributes.get_int("allowzero", 0):
        target = [data.shape[i] if s == 0 else s for i, s in enumerate(target)]
    return data.reshape(target)


def _gather(node: ir.Node, x: Arrays) -> np.ndarray | None:
    data, idx = x[0], x[1]
    if data is None or idx is None or idx.dtype.kind not in "iu":
        return None
    axis = node.attributes.get_int("axis", 0)
    n = data.shape[axis]
    if np.any(idx < -n) or np.any(idx >= n):
        return None
    return np.take(data, idx, axis=axis)


def _constant_of_shape(node: ir.Node, x: Arrays) -> np.ndarray | None:
    if x[0] is None:
        return None
    if "value" in node.attributes:
        fill = node.attributes["value"].value.numpy().reshape(-1)
    else:
        fill = np.zeros(1, dtype=np.float32)
    return np.full(tuple(int(d) for d in x[0].reshape(-1)), fill[0], dtype=fill.dtype)


def _cast(node: ir.Node, x: Arrays) -> np.ndarray | None:
    to = ir.DataType(node.attributes.get_int("to", 0))
    if (
        x[0] is None
        or x[0].dtype.kind not in "iub"
        or not (to.is_integer() or to == ir.DataType.BOOL)
    ):
        return None  # float conversions may round differently: left to onnxruntime
    return x[0].astype(to.numpy())


def _int_binary(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Callable[[ir.Node, Arrays], np.ndarray | None]:
    def run(node: ir.Node, x: Arrays) -> np.ndarray | None:
        a, b = x[0], x[1]
        if a is None or b is None or a.dtype != b.dtype or a.dtype.kind not in "iu":
            return None
        with np.errstate(over="ignore"):
            return fn(a, b)

    return run


_OPS: dict[str, Callable[[ir.Node, Arrays], np.ndarray | None]] = {
    "Identity": lambda node, x: x[0],
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "Gather": _gather,
    "ConstantOfShape": _constant_of_shape,
    "Cast": _cast,
    "Concat": lambda node, x: (
        None
        if any(a is None for a in x)
        else np.concatenate(list(x), axis=node.attributes.get_int("axis", 0))  # type: ignore[arg-type]
    ),
    "Transpose": lambda node, x: (
        None
        if x[0] is None or (perm := u.perm_of(node, x[0].ndim)) is None
        else np.transpose(x[0], perm)
    ),
    "Add": _int_binary(np.add),
    "Sub": _int_binary(np.subtract),
    "Mul": _int_binary(np.multiply),
}


def evaluate(
    nodes: Sequence[ir.Node], feeds: dict[int, np.ndarray], wanted: Sequence[ir.Value]
) -> list[np.ndarray] | None:
    """Values of ``wanted`` (keyed by value id in ``feeds`` for the constants), or ``None`` when
    some node is not one numpy evaluates exactly (the caller then uses onnxruntime)."""
    env = dict(feeds)
    for node in nodes:
        fn = _OPS.get(node.op_type)
        if fn is None or len(node.outputs) != 1:
            return None
        args = [env.get(id(v)) if v is not None else None for v in node.inputs]
        try:
            out = fn(node, args)
        except (ValueError, IndexError, TypeError):
            return None
        if out is None:
            return None
        env[id(node.outputs[0])] = np.asarray(out)
    try:
        return [env[id(v)] for v in wanted]
    except KeyError:
        return None
