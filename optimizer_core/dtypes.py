"""Sizes of tensors of every ONNX element type, the one place every layer asks.

``onnx_ir``'s ``DataType.itemsize`` and ``TensorBase.nbytes`` raise for an element type
without a bit width (``STRING``) and give fractions for the sub-byte ones (``INT4``, ``INT2``,
``FLOAT4E2M1``, ...). A pass or a loader that sizes a tensor to decide whether to fold, inline
or stream it must not fail on a valid model, so sizes come from here:

- fixed-width types: ``ceil(elements * bits / 8)``, the packed size onnx stores;
- strings: the bytes of the strings when the values are at hand, unknown (``None``) from a
  shape alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir


def itemsize(dtype: ir.DataType | None) -> float | None:
    """Bytes per element (0.5 for 4-bit types), or None for a type without a fixed width
    (``STRING``, ``UNDEFINED``) or an unknown one."""
    if dtype is None:
        return None
    try:
        return dtype.bitwidth / 8
    except TypeError:
        return None


def nbytes(dtype: ir.DataType | None, shape: Iterable[int]) -> int | None:
    """Bytes of a tensor of ``dtype`` and the static ``shape``, or None when the type has no
    fixed width."""
    size = itemsize(dtype)
    if size is None:
        return None
    return math.ceil(math.prod(shape) * size)


def tensor_nbytes(tensor: ir.TensorProtocol) -> int:
    """Bytes of ``tensor``'s data, for every element type: a string tensor counts the bytes of
    its strings."""
    if tensor.dtype == ir.DataType.STRING:
        strings = getattr(tensor, "string_data", None)
        if strings is not None:
            return sum(len(s) for s in strings())
        return int(sum(len(s) for s in tensor.numpy().reshape(-1)))
    fixed = nbytes(tensor.dtype, tensor.shape.numpy())
    return 0 if fixed is None else fixed


def tensor(array: np.ndarray, name: str | None = None) -> ir.TensorProtocol:
    """An ``onnx_ir`` tensor of ``array``: a ``StringTensor`` for strings (bytes, str or object
    arrays), which ``ir.Tensor`` would hold but cannot serialize."""
    if array.dtype.kind in "SUO":
        flat = [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
        strings = np.array(flat, dtype=object).reshape(array.shape)
        return ir.StringTensor(strings, shape=ir.Shape(array.shape), name=name)
    # np.ascontiguousarray would turn a 0-d array into 1-d
    return ir.Tensor(np.require(array, requirements="C"), name=name)


def proto_nbytes(data_type: int, dims: Iterable[int]) -> int | None:
    """:func:`nbytes` for a ``TensorProto``'s ``data_type`` and ``dims``: None for a string, a
    negative dim or a number that names no element type."""
    dims = list(dims)
    if any(d < 0 for d in dims):
        return None
    try:
        dtype = ir.DataType(data_type)
    except ValueError:
        return None
    return nbytes(dtype, dims)
