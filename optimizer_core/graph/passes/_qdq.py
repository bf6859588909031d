"""Helpers shared by the QDQ passes (``qdq`` and ``qdq-move``): quantization parameters, when a
``Q(DQ(x))`` round trip is exact, and copies of nodes moved across data movement."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u

D = ir.DataType

# integer quantized types: representable range
QRANGE: dict[ir.DataType, tuple[int, int]] = {
    D.INT8: (-128, 127),
    D.UINT8: (0, 255),
    D.INT16: (-32768, 32767),
    D.UINT16: (0, 65535),
    D.INT4: (-8, 7),
    D.UINT4: (0, 15),
}
# scale types: unit roundoff, smallest normal, largest finite
FLOAT_LIMITS: dict[ir.DataType, tuple[float, float, float]] = {
    D.FLOAT: (2.0**-24, 2.0**-126, float(np.finfo(np.float32).max)),
    D.FLOAT16: (2.0**-11, 2.0**-14, 65504.0),
    D.BFLOAT16: (2.0**-8, 2.0**-126, 3.3895313892515355e38),
}
# types the data-movement ops are moved onto (int4 is left alone: not every runtime moves it)
MOVABLE_TYPES = frozenset({D.INT8, D.UINT8, D.INT16, D.UINT16})
DATA_MOVEMENT = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
_DQ_ATTRS = frozenset({"axis", "block_size", "output_dtype"})
_Q_ATTRS = frozenset({"axis", "block_size", "output_dtype", "saturate", "precision"})


@dataclasses.dataclass(frozen=True)
class QParams:
    """The quantization parameters of a Q or DQ node."""

    scale: ir.Value
    zero_point: ir.Value | None
    qtype: ir.DataType  # the quantized type
    ftype: ir.DataType | None  # the scale's (float) type, when known
    axis: int
    block_size: int


def dtype_of(value: ir.Value | None) -> ir.DataType | None:
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    if value.const_value is not None:
        return value.const_value.dtype
    arr = u.const_array(value)
    if arr is None:
        return None
    try:
        return ir.DataType.from_numpy(arr.dtype)
    except TypeError:
        return None


def numel(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    shape = u.static_shape(value)
    if shape is not None:
        return math.prod(shape)
    arr = u.const_array(value)
    return None if arr is None else int(arr.size)


def input_at(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def params(node: ir.Node) -> QParams | None:
    """The parameters of a standard Q or DQ node whose attributes are all understood."""
    quantize = node.op_type == "QuantizeLinear"
    known = _Q_ATTRS if quantize else _DQ_ATTRS
    if any(name not in known for name in node.attributes):
        return None
    scale = input_at(node, 1)
    zero_point = input_at(node, 2)
    if scale is None:
        return None
    ftype = dtype_of(scale)
    output_dtype = node.attributes.get_int("output_dtype", 0)
    if quantize:
        if zero_point is not None:
            qtype = dtype_of(zero_point)
        elif output_dtype:
            qtype = D(output_dtype)
        else:
            qtype = D.UINT8
        if output_dtype and qtype != D(output_dtype):
            return None
        precision = node.attributes.get_int("precision", 0)
        if precision and (ftype is None or D(precision) != ftype):
            return None  # the division runs in another precision
    else:
        qtype = dtype_of(node.inputs[0]) or dtype_of(zero_point)
        if output_dtype and (ftype is None or D(output_dtype) != ftype):
            return None
    if qtype is None or qtype not in QRANGE:
        return None
    return QParams(
        scale,
        zero_point,
        qtype,
        ftype,
        node.attributes.get_int("axis", 1),
        node.attributes.get_int("block_size", 0),
    )


def per_tensor(p: QParams) -> bool:
    return (
        p.block_size == 0
        and numel(p.scale) == 1
        and (p.zero_point is None or numel(p.zero_point) == 1)
    )


def same_array(a: ir.Value, b: ir.Value) -> bool:
    if a is b:
        return True
    x, y = u.const_array(a), u.const_array(b)
    if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape:
        return False
    return bool(np.array_equal(x, y))


def same_zero_point(a: ir.Value | None, b: ir.Value | None) -> bool:
    if a is None and b is None:
        return True
    if a is not None and b is not None:
        return same_array(a, b)
    given = a if a is not None else b
    arr = u.const_array(given)
    return arr is not None and arr.size > 0 and bool(np.all(arr.astype(np.int64) == 0))


def same_params(a: QParams, b: QParams, rank: int | None) -> bool:
    if a.qtype != b.qtype or a.ftype is None or a.ftype != b.ftype:
        return False
    if a.block_size != b.block_size:
        return False
    if not same_array(a.scale, b.scale) or not same_zero_point(a.zero_point, b.zero_point):
        return False
    if per_tensor(a):
        return True  # the axis plays no part
    if a.axis == b.axis:
        return True
    if rank is None:
        return False
    return u.normalize_axes([a.axis], rank) == u.normalize_axes([b.axis], rank)


def round_trip_exact(p: QParams) -> bool:
    """``Q(DQ(x))`` returns every representable ``x`` unchanged (see the module docstring)."""
    if p.ftype not in FLOAT_LIMITS:
        return False
    roundoff, tiny, largest = FLOAT_LIMITS[p.ftype]
    qmin, qmax = QRANGE[p.qtype]
    span = qmax - qmin
    if 3 * roundoff * span > 0.4:
        return False
    scale = u.const_array(p.scale)
    if scale is None or scale.size == 0:
        return False
    mag = np.abs(scale.astype(np.float64))
    return bool(np.all(np.isfinite(mag) & (mag >= tiny) & (mag * span <= largest / 2)))


def copy_shape(shape: ir.Shape | None) -> ir.Shape | None:
    return None if shape is None else ir.Shape(list(shape.dims))


def copy_attrs(node: ir.Node) -> list[ir.Attr]:
    return [
        ir.Attr(a.name, a.type, a.value, ref_attr_name=a.ref_attr_name)
        for a in node.attributes.values()
    ]


def clone(
    node: ir.Node, inputs: list[ir.Value | None], out_name: str, out_type: ir.DataType | None
) -> ir.Node:
    """A copy of ``node`` (same op, attributes and version) on ``inputs``, with one output."""
    out = ir.Value(
        name=out_name,
        type=ir.TensorType(out_type) if out_type is not None else None,
    )
    return ir.Node(
        node.domain,
        node.op_type,
        inputs,
        copy_attrs(node),
        outputs=[out],
        version=node.version,
        name=node.name,
    )


def movement_reader(value: ir.Value) -> ir.Node | None:
    """The data-movement op that alone reads ``value``, as its data input."""
    if not u.single_consumer(value):
        return None
    user, index = next(iter(value.uses()))
    if index != 0 or not u.is_op(user, *DATA_MOVEMENT) or len(user.outputs) != 1:
        return None
    return user
