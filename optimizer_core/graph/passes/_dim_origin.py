"""Where a dim comes from: the earliest value whose dim is provably the same at run time.

``origin(y, i)`` follows dim ``i`` of ``y`` up through the ops that carry a dim unchanged (ops
that keep their input's shape, Transpose, broadcasting ops, MatMul, Gather, reductions over
other axes, Unsqueeze/Squeeze, Concat and Split off their axis, Slice of other axes, and Conv
and pooling windows that keep a spatial dim: stride 1 and pads that make up the window) and
returns the value and dim where that stops. Two dims with the same origin are equal on every
input the model runs on, named or not. The ``symbolic-shapes`` rule ``shape-read-origin`` reads
a dim up its chain (``read_point``: the furthest value there that already has several readers),
so that reads of one dim through different values (the sequence length read from each of a
layer's query, key and value projections) become one read; ``reads`` proves a Reshape or Expand
entry equal to the input's own dim.

A broadcasting op carries a dim from the inputs whose dim is not a static 1; when there are
several, only if they have one origin (a broadcast of equal dims is that dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._symbolic_dims import BROADCASTING, shape_span

# ops whose first output has the shape of their first input
_KEEPING = u._SHAPE_KEEPING | {
    "BatchNormalization", "InstanceNormalization", "GroupNormalization", "Not", "Sign", "Floor",
    "Ceil", "Round", "IsNaN", "IsInf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
    "Cosh", "Asinh", "Acosh", "Atanh", "Softsign", "ThresholdedRelu", "Shrink", "Celu",
    "Hardmax", "LpNormalization", "CumSum", "Trilu", "Bernoulli",
}  # fmt: skip
_BROADCASTING = BROADCASTING | {"BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Mean"}
_REDUCE = {
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
}  # fmt: skip
_WINDOWED = {"Conv", "MaxPool", "AveragePool", "LpPool"}

Origin = tuple[ir.Value, int]


class DimOrigins:
    """``origin`` with its answers kept (one instance per scan of the graph: a rewrite
    between two questions may change what the producers are)."""

    def __init__(self, model: ir.Model) -> None:
        self.opset = u.opset_version(model)
        # keyed by the value itself (identity), which the memo keeps alive: an id could be
        # reused by a value made after a rewrite freed the one it named
        self._memo: dict[Origin, Origin] = {}
        # a named dim (not one inference invented) is read where the model takes it in: dims
        # of one name are equal in one model (the meaning of a shared dim_param)
        self._inputs: dict[str, Origin] = {}
        for v in model.graph.inputs:
            if not u.is_tensor_value(v):
                continue  # a sequence's shape is its elements'
            for j, d in enumerate(u.symbolic_dims(v) or []):
                if isinstance(d, str) and d and not d.startswith("unk__"):
                    self._inputs.setdefault(d, (v, j))

    def origin(self, value: ir.Value, i: int, depth: int = 0) -> Origin:
        key = (value, i)
        found = self._memo.get(key)
        if found is None:
            hop = self._hop(value, i, depth) if depth < 64 else None
            found = (value, i) if hop is None else self.origin(hop[0], hop[1], depth + 1)
            self._memo[key] = found
        return found

    def read_point(self, value: ir.Value, i: int) -> Origin:
        """Where to read dim ``i`` of ``value``: the furthest value up its chain to the origin
        that another read does not make a new branch of. A graph input or constant, a value
        that is read more than once already, or one a Shape already reads: a value that feeds
        one node alone keeps feeding one node alone (runtimes fuse single-reader chains, a
        Conv into its activation, a sum into the normalization after it)."""
        chain: list[Origin] = []
        at: Origin | None = (value, i)
        while at is not None and len(chain) < 64:
            chain.append(at)
            at = self._hop(at[0], at[1], 0)
        for v, j in reversed(chain[1:]):
            if _branches_already(v):
                return (v, j)
        return (value, i)

    def reads(self, shape: ir.Value | None, k: int, x: ir.Value | None, i: int) -> bool:
        """Entry ``k`` of the shape tensor ``shape`` is a read of a dim with the origin of
        ``x``'s dim ``i`` (so it equals that dim, named or not)."""
        if shape is None or x is None:
            return False
        read = entry_read(shape, k)
        if read is None:
            return False
        a, b = self.origin(*read), self.origin(x, i)
        return a[0] is b[0] and a[1] == b[1]

    def _hop(self, value: ir.Value, i: int, depth: int) -> Origin | None:
        """The next (value, dim) up the chain of ``value``'s dim ``i``; ``None`` at its origin."""
        if not u.is_tensor_value(value):
            return None
        dims = u.symbolic_dims(value)
        name = dims[i] if dims is not None and 0 <= i < len(dims) else None
        if isinstance(name, str) and name in self._inputs:
            named_at = self._inputs[name]
            return None if named_at[0] is value and named_at[1] == i else named_at
        node = value.producer()
        if node is None or not u.is_standard(node) or u.has_subgraph(node):
            return None
        r = u.rank(value)
        if r is None or not 0 <= i < r:
            return None
        op = node.op_type
        ins = node.inputs
        if not ins or ins[0] is None:
            return None
        x = ins[0]
        up = self._carried(node, op, value, i, r, x)
        if up is None or any(not u.is_tensor_value(v) for v, _ in _listed(up)):
            return None
        if isinstance(up, list):  # several inputs that must agree
            found = {self.origin(v, j, depth + 1) for v, j in up}
            return up[0] if len(found) == 1 else None
        return up

    def _carried(
        self, node: ir.Node, op: str, value: ir.Value, i: int, r: int, x: ir.Value
    ) -> Origin | list[Origin] | None:
        """The input dim(s) that dim ``i`` of ``value`` (rank ``r``) is, one step up."""
        if op in _KEEPING:
            return (x, i) if value is node.outputs[0] and u.rank(x) == r else None
        if op == "Transpose":
            perm = node.attributes.get_ints("perm", None)
            perm = list(range(r))[::-1] if perm is None else list(perm)
            return (x, perm[i]) if sorted(perm) == list(range(r)) else None
        if op in _BROADCASTING:
            return _broadcast(node.inputs, i, r)
        if op == "MatMul":
            return _matmul(node.inputs, i, r)
        if op == "Gather":
            return _gather(node, i, r)
        if op in _REDUCE:
            return self._reduce(node, i, r)
        if op in ("Unsqueeze", "Squeeze"):
            return self._unsqueeze(node, i, r)
        if op in ("Concat", "Split"):
            axis = node.attributes.get_int("axis", 0)
            xr = u.rank(x)
            if xr != r:
                return None
            axis = axis + r if axis < 0 else axis
            return None if i == axis else (x, i)
        if op == "Slice":
            return self._slice(node, i, r)
        if op == "Reshape":
            return _reshaped(node, i, r)
        if op in _WINDOWED:
            return _window(node, i, r) if value is node.outputs[0] else None
        return None

    def _reduce(self, node: ir.Node, i: int, r: int) -> Origin | None:
        x = node.inputs[0]
        xr = u.rank(x) if x is not None else None
        if x is None or xr is None:
            return None
        axes = node.attributes.get_ints("axes", None)
        if node.op_type in ("ArgMax", "ArgMin"):
            axes = [node.attributes.get_int("axis", 0)]
        elif axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            axes = u.const_ints(node.inputs[1])
            if axes is None:
                return None
        if not axes:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                return (x, i) if r == xr else None
            return None  # every axis reduced
        norm = u.normalize_axes(list(axes), xr)
        if norm is None:
            return None
        if node.attributes.get_int("keepdims", 1):
            return None if r != xr or i in norm else (x, i)
        kept = [j for j in range(xr) if j not in norm]
        return (x, kept[i]) if len(kept) == r else None

    def _unsqueeze(self, node: ir.Node, i: int, r: int) -> Origin | None:
        x = node.inputs[0]
        xr = u.rank(x)
        if x is None or xr is None:
            return None
        axes = node.attributes.get_ints("axes", None)
        if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
            axes = u.const_ints(node.inputs[1])
        if axes is None:
            return None
        axes = list(axes)
        if node.op_type == "Unsqueeze":
            norm = u.normalize_axes(axes, r)
            if norm is None or i in norm or r != xr + len(norm):
                return None
            return (x, i - sum(1 for a in norm if a < i))
        norm = u.normalize_axes(axes, xr)
        if norm is None or not norm or xr != r + len(norm):
            return None
        kept = [j for j in range(xr) if j not in norm]
        return (x, kept[i])

    def _slice(self, node: ir.Node, i: int, r: int) -> Origin | None:
        x = node.inputs[0]
        if x is None or u.rank(x) != r:
            return None
        if self.opset < 10:
            axes = node.attributes.get_ints("axes", None)
            starts = node.attributes.get_ints("starts", None)
            axes = list(range(len(starts))) if axes is None and starts is not None else axes
        elif len(node.inputs) > 3 and node.inputs[3] is not None:
            axes = u.const_ints(node.inputs[3])
        else:
            starts_v = node.inputs[1] if len(node.inputs) > 1 else None
            n = u.const_shape(starts_v) if starts_v is not None else None
            n = n or (u.dims(starts_v) if starts_v is not None else None)  # type: ignore[assignment]
            if not n or n[0] is None:
                return None
            axes = list(range(int(n[0])))
        if axes is None:
            return None
        norm = u.normalize_axes(list(axes), r)
        return None if norm is None or i in norm else (x, i)


def _branches_already(v: ir.Value) -> bool:
    if v.producer() is None or v.is_graph_output():
        return True
    readers = {id(use.node): use.node for use in v.uses()}
    return len(readers) > 1 or any(u.is_op(n, "Shape", "Size") for n in readers.values())


def _listed(up: Origin | list[Origin]) -> list[Origin]:
    return up if isinstance(up, list) else [up]


def _static(value: ir.Value, j: int) -> int | None:
    d = u.dims(value)
    return None if d is None or j >= len(d) else d[j]


def _broadcast(inputs: Sequence[ir.Value | None], i: int, r: int) -> list[Origin] | None:
    carriers: list[Origin] = []
    for v in inputs:
        if v is None:
            continue
        vr = u.rank(v)
        if vr is None:
            return None
        j = i - (r - vr)
        if j < 0 or _static(v, j) == 1:
            continue  # broadcast along this dim
        carriers.append((v, j))
    return carriers or None


def _matmul(inputs: Sequence[ir.Value | None], i: int, r: int) -> Origin | list[Origin] | None:
    a, b = (inputs[0], inputs[1]) if len(inputs) == 2 else (None, None)
    if a is None or b is None:
        return None
    ra, rb = u.rank(a), u.rank(b)
    if ra is None or rb is None or ra < 2 or rb < 2:
        return None
    if i == r - 2:
        return (a, ra - 2)
    if i == r - 1:
        return (b, rb - 1)
    return _broadcast((a, b), i, r)  # the batch dims broadcast


def _gather(node: ir.Node, i: int, r: int) -> Origin | None:
    data, idx = (node.inputs[0], node.inputs[1]) if len(node.inputs) == 2 else (None, None)
    if data is None or idx is None:
        return None
    dr, ir_ = u.rank(data), u.rank(idx)
    if dr is None or ir_ is None or r != dr - 1 + ir_:
        return None
    axis = node.attributes.get_int("axis", 0)
    axis = axis + dr if axis < 0 else axis
    if i < axis:
        return (data, i)
    if i < axis + ir_:
        return (idx, i - axis)
    return (data, i - ir_ + 1)


def _reshaped(node: ir.Node, i: int, r: int) -> Origin | None:
    """``Reshape(x, s)``: entry ``i`` of ``s`` read from a dim (``Shape``, ``Gather`` of it,
    ``Unsqueeze`` of a scalar read, ``Concat`` of such pieces), or a constant ``0`` that copies
    x's dim (``allowzero`` 0)."""
    x, s = (node.inputs[0], node.inputs[1]) if len(node.inputs) == 2 else (None, None)
    if x is None or s is None:
        return None
    ints = u.const_ints(s)
    if ints is not None:
        allowzero = node.attributes.get_int("allowzero", 0)
        if len(ints) != r or ints[i] != 0 or allowzero:
            return None
        xr = u.rank(x)
        return (x, i) if xr is not None and i < xr else None
    return entry_read(s, i)


def entry_read(s: ir.Value, k: int, depth: int = 0) -> Origin | None:
    """The tensor dim that entry ``k`` of the 1-D int64 shape tensor ``s`` reads, if it is a
    plain read of one."""
    node = s.producer()
    if node is None or not u.is_standard(node) or depth > 8:
        return None
    op = node.op_type
    if op == "Shape":
        z = node.inputs[0]
        zr = u.rank(z)
        if z is None or zr is None:
            return None
        start, end = shape_span(node, zr)
        return (z, start + k) if start + k < end else None
    if op == "Concat" and node.attributes.get_int("axis", 0) in (0, -1):
        offset = 0
        for piece in node.inputs:
            n = u.dims(piece) if piece is not None else None
            if piece is None or n is None or len(n) != 1 or n[0] is None:
                return None
            if k < offset + n[0]:
                return entry_read(piece, k - offset, depth + 1)
            offset += n[0]
        return None
    if op == "Unsqueeze" and k == 0 and u.rank(node.outputs[0]) == 1:
        return _scalar_read(node.inputs[0], depth + 1)
    if op == "Gather" and node.attributes.get_int("axis", 0) == 0 and len(node.inputs) == 2:
        idx = u.const_ints(node.inputs[1])
        if idx is None or u.rank(node.inputs[1]) != 1 or not 0 <= k < len(idx):
            return None
        return _indexed(node.inputs[0], idx[k], depth + 1)
    return None


def _scalar_read(g: ir.Value | None, depth: int) -> Origin | None:
    node = g.producer() if g is not None else None
    if node is None or not u.is_op(node, "Gather") or len(node.inputs) != 2:
        return None
    idx = u.const_ints(node.inputs[1])
    if idx is None or u.rank(node.inputs[1]) != 0 or node.attributes.get_int("axis", 0) != 0:
        return None
    return _indexed(node.inputs[0], idx[0], depth)


def _indexed(shape: ir.Value | None, j: int, depth: int) -> Origin | None:
    """Entry ``j`` (negative from the end) of ``shape``, a Shape's output."""
    node = shape.producer() if shape is not None else None
    if node is None or not u.is_op(node, "Shape") or shape is None:
        return None
    n = u.dims(shape)
    if n is None or len(n) != 1 or n[0] is None:
        return None
    j = j + n[0] if j < 0 else j
    return entry_read(shape, j, depth) if 0 <= j < n[0] else None


def _window(node: ir.Node, i: int, r: int) -> Origin | None:
    """Conv and pooling: the batch dim always; a spatial dim where stride 1 and the pads make
    up the (dilated) window, so the output is as long as the input."""
    x = node.inputs[0]
    if x is None or u.rank(x) != r:
        return None
    if i == 0:
        return (x, 0)
    if i == 1:
        return (x, 1) if node.op_type != "Conv" else None
    k = i - 2
    kernel = node.attributes.get_ints("kernel_shape", None)
    if kernel is None and node.op_type == "Conv" and len(node.inputs) > 1:
        w = node.inputs[1]
        wd = u.dims(w) if w is not None else None
        kernel = None if wd is None or any(d is None for d in wd[2:]) else wd[2:]  # type: ignore[assignment]
    if kernel is None or len(kernel) != r - 2:
        return None
    strides = list(node.attributes.get_ints("strides", [1] * (r - 2)))
    dilations = list(node.attributes.get_ints("dilations", [1] * (r - 2)))
    if strides[k] != 1:
        return None
    span = dilations[k] * (int(kernel[k]) - 1)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return (x, i)
    if auto_pad == "VALID":
        return (x, i) if span == 0 else None
    pads = list(node.attributes.get_ints("pads", [0] * (2 * (r - 2))))
    if len(pads) != 2 * (r - 2):
        return None
    return (x, i) if pads[k] + pads[k + r - 2] == span else None
