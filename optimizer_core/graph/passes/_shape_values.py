"""Shape arithmetic folded without running anything (pass ``constant-folding``): the value of
``Shape(x)``, ``Size(x)``, ``Gather(Shape(x), i)`` and ``Slice(Shape(x), ...)`` when the dims they
read are static. Each check returns the value (int64) or why it declines."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import RuleContext


def _gate(node: ir.Node) -> str | None:
    if not node.outputs:
        return "no output"
    out = node.outputs[0]
    if out.is_graph_output():
        return "the value is a graph output"
    if u.is_constant(out):
        return "the value is a constant already"
    return None


def _shape_range(src: ir.Node, r: int) -> tuple[int, int]:
    """``start`` and ``end`` of a Shape node over a rank-``r`` input, clamped like ONNX does."""
    start = src.attributes.get_int("start", 0)
    end = src.attributes.get_int("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    return start, end


def _slice_of_shape(node: ir.Node, src: ir.Node, d: list[int | None]) -> list[int | None] | None:
    """The dims ``Slice(Shape(x), ...)`` selects, when its arguments are constants."""
    starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
    axes = (
        u.const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
    )
    steps = (
        u.const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
    )
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if len(starts) != 1 or len(ends) != 1 or axes not in ([0], [-1]) or steps != [1]:
        return None
    start, end = _shape_range(src, len(d))
    # step 1: ONNX clamps start and end like Python slicing does
    return d[start:end][starts[0] : ends[0]]


def check_shape(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    gate = _gate(node)
    if gate is not None:
        return gate
    d = u.dims(node.inputs[0])
    if d is None:
        return "the input's rank is unknown"
    start, end = _shape_range(node, len(d))
    picked = d[start:end]
    if not all(x is not None for x in picked):
        return "a dim read is not static"
    return np.array(picked, dtype=np.int64)


def check_size(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    gate = _gate(node)
    if gate is not None:
        return gate
    s = u.static_shape(node.inputs[0])
    if s is None:
        return "the input's shape is not static"
    return np.array(int(np.prod(s, dtype=np.int64)), dtype=np.int64)


def check_gather_shape(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    gate = _gate(node)
    if gate is not None:
        return gate
    src = node.inputs[0].producer() if node.inputs[0] is not None else None
    if src is None or not u.is_op(src, "Shape") or node.attributes.get_int("axis", 0) != 0:
        return "not a Gather on axis 0 of a Shape"
    d = u.dims(src.inputs[0])
    idx = u.const_array(node.inputs[1])
    if d is None or idx is None or idx.dtype.kind not in "iu":
        return "the rank is unknown or the indices are not integer constants"
    start, end = _shape_range(src, len(d))
    sliced = d[start:end]
    flat = [int(i) + len(sliced) if int(i) < 0 else int(i) for i in idx.reshape(-1)]
    if not all(0 <= i < len(sliced) and sliced[i] is not None for i in flat):
        return "a gathered dim is not static (or out of range)"
    return np.array([sliced[i] for i in flat], dtype=np.int64).reshape(idx.shape)


def check_slice_shape(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    gate = _gate(node)
    if gate is not None:
        return gate
    if node.inputs[0] is None or len(node.inputs) < 3:
        return "not a Slice with starts and ends"
    src = node.inputs[0].producer()
    d = u.dims(src.inputs[0]) if src is not None and u.is_op(src, "Shape") else None
    if d is None or src is None:
        return "not a Slice of a Shape of known rank"
    sel = _slice_of_shape(node, src, d)
    if sel is None or any(x is None for x in sel):
        return "the arguments are not constants, or a selected dim is not static"
    return np.array(sel, dtype=np.int64)


def check_equal_dims(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    """``Equal(s, c)`` of a shape ``s`` read entry by entry and a constant ``c`` (either order):
    decided where each entry is constant, a static dim, or a dim compared with a negative
    number (a dim is never negative: an ``expand(B, -1, -1)`` test for -1)."""
    from graphtrim.graph.passes._symbolic_dims import Dim, shape_entries

    gate = _gate(node)
    if gate is not None:
        return gate
    if len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return "not two inputs"
    sides = [u.const_array(v) for v in node.inputs]
    if sides[0] is not None and sides[1] is not None:
        return "both constant: folding evaluates it"
    k = 1 if sides[1] is not None else 0
    c = sides[k]
    if c is None or c.dtype != np.int64 or c.ndim > 1:
        return "no int64 vector or scalar constant"
    other = node.inputs[1 - k]
    entries = shape_entries(other)
    rank = u.rank(other)
    if entries is None or rank is None or rank > 1:
        return "the other side is no shape read entry by entry"
    try:
        out_shape = np.broadcast_shapes((len(entries),) if rank else (), c.shape)
    except ValueError:
        return "the shapes do not broadcast"
    values = c.reshape(-1).tolist()
    if len(values) == 1:
        values = values * len(entries)
    if len(values) != len(entries):
        return "lengths differ"
    out = []
    for e, v in zip(entries, values, strict=True):
        if isinstance(e, int):
            out.append(e == v)
        elif isinstance(e, Dim) and isinstance(e.value, int):
            out.append(e.value == v)
        elif isinstance(e, Dim) and v < 0:
            out.append(False)
        else:
            return "an entry that is neither static nor compared with a negative number"
    return np.array(out, dtype=bool).reshape(out_shape)


def check_dims_arithmetic(node: ir.Node, ctx: RuleContext) -> np.ndarray | str:
    """``Add``, ``Sub``, ``Mul`` or ``Div`` of shape entries whose every result is a size for
    every value of the dim names: ``(64*batch) / batch`` is 64, ``seq - seq`` is 0."""
    from graphtrim.graph.passes._symbolic_dims import Dim, shape_entries

    gate = _gate(node)
    if gate is not None:
        return gate
    if all(v is not None and u.is_constant(v) for v in node.inputs):
        return "every input is constant: folding evaluates it"
    entries = shape_entries(node.outputs[0])
    rank = u.rank(node.outputs[0])
    if entries is None or rank not in (0, 1) or (rank == 0 and len(entries) != 1):
        return "the result is no shape read entry by entry"
    sizes = [e.value if isinstance(e, Dim) else e for e in entries]
    if not all(isinstance(v, int) for v in sizes):
        return "an entry depends on a dim's value"
    return np.array(sizes, dtype=np.int64).reshape((len(sizes),) if rank else ())
