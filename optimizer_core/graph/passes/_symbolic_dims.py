"""Symbolic dims for the ``symbolic-shapes`` pass: a 1-D int64 shape tensor read entry by entry
(a constant, a dim read from a tensor at run time, or unknown) and dims given to the values a
rewrite proves them for.

Named symbolic dims are equal when their names are; anonymous dims are never taken as equal.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u


@dataclasses.dataclass(frozen=True)
class Dim:
    """A shape entry read from a tensor's dim at run time: a static size or a dim name."""

    value: int | str


Entry = int | Dim | None  # a constant, a known dim, or unknown


def named(value: ir.Value | None) -> list[int | str | None] | None:
    dims = u.symbolic_dims(value)
    if dims is None:
        return None
    # names onnx_ir invents for unknown dims are not names of a size
    return [d if isinstance(d, int) or (isinstance(d, str) and d) else None for d in dims]


def _shape_dims(node: ir.Node) -> list[Entry] | None:
    """Entries of ``Shape(y, start, end)``."""
    dims = named(node.inputs[0])
    if dims is None:
        return None
    start, end = shape_span(node, len(dims))
    return [None if d is None else Dim(d) for d in dims[start:end]]


def shape_span(node: ir.Node, rank: int) -> tuple[int, int]:
    """The dims ``[start, end)`` that ``Shape(y, start, end)`` reads of a rank-``rank`` ``y``:
    negative bounds count from the end, and both are clamped to ``[0, rank]``."""
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return start, end


def shape_entries(value: ir.Value | None, depth: int = 0) -> list[Entry] | None:
    """The 1-D int64 ``value`` entry by entry; ``None`` when not even its length is known."""
    if value is None or depth > 8:
        return None
    ints = u.const_ints(value)
    if ints is not None:
        return list(ints)
    node = value.producer()
    if node is not None and u.is_standard(node):
        op = node.op_type
        if op == "Shape":
            return _shape_dims(node)
        if op == "Concat" and node.attributes.get_int("axis", 0) in (0, -1):
            out: list[Entry] = []
            for piece in node.inputs:
                part = shape_entries(piece, depth + 1)
                if part is None:
                    return None
                out.extend(part)
            return out
        if op in ("Gather", "Slice", "Unsqueeze", "Squeeze"):
            found = _picked(node, depth)
            if found is not None:
                return found
        if op == "Reshape" and u.const_ints(node.inputs[1]) in ([-1], [1]):
            # a one-entry shape (a scalar dim, as exporters compute a sum of dims) made 1-D
            found = shape_entries(node.inputs[0], depth + 1)
            if found is not None and len(found) == 1:
                return found
        if op == "Cast":
            found = _integer_cast(node, depth)
            if found is not None:
                return found
        if op == "Where" and len(node.inputs) == 3:
            found = _chosen(node, depth)
            if found is not None:
                return found
        if op in ("Add", "Sub", "Mul", "Div") and len(node.inputs) == 2:
            found = _arithmetic(node, depth)
            if found is not None:
                return found
        if op in ("Max", "Min") and len(node.inputs) == 2:
            found = _extremum(node, depth)
            if found is not None:
                return found
    shape = u.static_shape(value)
    if shape is not None and len(shape) == 1:
        return [None] * shape[0]
    if shape is not None and len(shape) == 0:
        return [None]
    return None


def _arithmetic(node: ir.Node, depth: int) -> list[Entry] | None:
    """``a + b``, ``a - b``, ``a * k`` (``k`` constant) and an exact ``a / b`` of shape entries,
    entry by entry: a sum of dims and sizes is a dim named by its terms (:mod:`._dim_exprs`), a
    quotient is a size or a name where it is one for every value of the names
    (``(64*batch) / batch`` is 64)."""
    from graphtrim.graph.passes import _dim_exprs as x

    if u.rank(node.outputs[0]) not in (0, 1) or node.outputs[0].dtype != ir.DataType.INT64:
        return None
    a, b = shape_entries(node.inputs[0], depth + 1), shape_entries(node.inputs[1], depth + 1)
    if a is None or b is None or (len(a) not in (1, len(b)) and len(b) != 1):
        return None
    n = max(len(a), len(b))
    a, b = a * n if len(a) == 1 else a, b * n if len(b) == 1 else b
    out: list[Entry] = []
    for ea, eb in zip(a, b, strict=True):
        va = ea.value if isinstance(ea, Dim) else ea
        vb = eb.value if isinstance(eb, Dim) else eb
        if va is None or vb is None:
            out.append(None)
            continue
        r: int | str | None
        if node.op_type == "Div":
            q = x.quotient(x.monomial(va), x.monomial(vb))
            if q is None:
                out.append(None)  # no whole size or name for every value of the names
                continue
            r = q
        elif node.op_type == "Mul":
            if isinstance(va, int) and isinstance(vb, int):
                r = va * vb
            elif isinstance(vb, int) and isinstance(ea, Dim) and not isinstance(eb, Dim):
                r = x.scale(va, vb)
            elif isinstance(va, int) and isinstance(eb, Dim) and not isinstance(ea, Dim):
                r = x.scale(vb, va)
            else:
                out.append(None)  # a product of dims is no linear term
                continue
        else:
            r = x.add(va, vb, 1 if node.op_type == "Add" else -1)
        out.append(r if isinstance(r, int) else Dim(r))  # a sum whose names cancel is a size
    return out


def _extremum(node: ir.Node, depth: int) -> list[Entry] | None:
    """``Max(a, b)`` / ``Min(a, b)`` of shapes entry by entry (tf2onnx broadcasts the batch
    dims of an einsum's operands so): two static sizes give theirs, two entries of one dim
    name give it (``max(d, d) = d``); anything else is unknown."""
    if node.outputs[0].dtype != ir.DataType.INT64 or u.rank(node.outputs[0]) != 1:
        return None
    a, b = shape_entries(node.inputs[0], depth + 1), shape_entries(node.inputs[1], depth + 1)
    if a is None or b is None or len(a) != len(b):
        return None
    pick = max if node.op_type == "Max" else min
    out: list[Entry] = []
    for ea, eb in zip(a, b, strict=True):
        va = ea.value if isinstance(ea, Dim) else ea
        vb = eb.value if isinstance(eb, Dim) else eb
        if isinstance(va, int) and isinstance(vb, int):
            out.append(pick(va, vb))
        elif va is not None and va == vb:
            out.append(ea)
        else:
            out.append(None)
    return out


def _chosen(node: ir.Node, depth: int) -> list[Entry] | None:
    """``Where(c, a, b)`` of 1-D shapes under a constant condition (``expand(B, -1, -1)`` as
    TorchScript writes it: -1 entries replaced by 1): each entry taken from ``a`` or ``b``."""
    cond = u.const_array(node.inputs[0])
    if cond is None or cond.dtype != np.bool_ or cond.ndim > 1:
        return None
    a, b = shape_entries(node.inputs[1], depth + 1), shape_entries(node.inputs[2], depth + 1)
    if a is None or b is None:
        return None
    n = max(len(a), len(b), cond.size)
    if any(len(side) not in (1, n) for side in (a, b)) or cond.size not in (1, n):
        return None
    flags = np.broadcast_to(cond.reshape(-1), (n,))
    a, b = a * n if len(a) == 1 else a, b * n if len(b) == 1 else b
    return [x if f else y for f, x, y in zip(flags.tolist(), a, b, strict=True)]


_INT32 = (-(2**31), 2**31 - 1)


def _integer_cast(node: ir.Node, depth: int) -> list[Entry] | None:
    """``Cast`` of a shape between int64 and int32 (tf2onnx writes TensorFlow's int32 shapes:
    ``Shape -> Cast(int32) -> .. -> Cast(int64) -> Reshape``): the entries keep their values.
    A constant outside int32's range that is cast to int32 becomes unknown; a dim read from a
    tensor is taken as it is: a model that computes its shapes in int32 is defined for dims
    below 2**31 only (it would compute a wrapped size for a larger one)."""
    src = node.inputs[0] if node.inputs else None
    to = node.attributes.get_int("to", 0)
    if src is None or src.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    if to not in (ir.DataType.INT64.value, ir.DataType.INT32.value):
        return None
    found = shape_entries(src, depth + 1)
    if found is None or to == ir.DataType.INT64.value:
        return found
    lo, hi = _INT32
    return [e if not isinstance(e, int) or lo <= e <= hi else None for e in found]


def _picked(node: ir.Node, depth: int) -> list[Entry] | None:
    """Gather / Slice of a shape, or Unsqueeze / Squeeze of a one-entry shape."""
    op = node.op_type
    src = shape_entries(node.inputs[0], depth + 1)
    if src is None:
        return None
    if op in ("Unsqueeze", "Squeeze"):
        return src if len(src) == 1 else None
    if op == "Gather":
        if node.attributes.get_int("axis", 0) != 0:
            return None
        idx = u.const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if idx is None or idx.dtype.kind not in "iu" or idx.ndim > 1:
            return None
        out = []
        for i in idx.reshape(-1).tolist():
            if not -len(src) <= i < len(src):
                return None
            out.append(src[i])
        return out
    # Slice of a 1-D shape with constant bounds
    bounds = [u.const_ints(v) if v is not None else None for v in node.inputs[1:]]
    if len(bounds) < 2 or bounds[0] is None or bounds[1] is None:
        return None
    starts, ends = bounds[0], bounds[1]
    axes = bounds[2] if len(bounds) > 2 else [0]
    steps = bounds[3] if len(bounds) > 3 else [1]
    if axes is None or steps is None or len(starts) != 1 or list(axes) not in ([0], [-1]):
        return None
    return list(np.array(src, dtype=object)[slice(starts[0], ends[0], steps[0])])


def name_reshape_dims(node: ir.Node, target: list[int]) -> None:
    """Give the Reshape's output the dims its constant shape proves: copied dims keep the input's
    names, and a ``-1`` is computed when every input dim it stands for is static (onnx's own
    inference leaves it unnamed whenever the input has a symbolic dim)."""
    x_dims = u.symbolic_dims(node.inputs[0])
    if x_dims is None:
        return
    dims: list[int | str | None] = []
    copied = set()
    for j, t in enumerate(target):
        if t == 0:
            dims.append(x_dims[j])
            copied.add(j)
        else:
            dims.append(t if t > 0 else None)
    if -1 in target:
        rest = [d for j, d in enumerate(x_dims) if j not in copied]
        known = [t for t in target if t > 0]
        if any(not isinstance(d, int) for d in rest):
            return
        total, part = int(np.prod(rest)), int(np.prod(known))  # type: ignore[arg-type]
        if part == 0 or total % part:
            return
        dims[target.index(-1)] = total // part
    old = node.outputs[0].shape
    if old is not None and len(old) != len(dims):
        return
    node.outputs[0].shape = ir.Shape(
        [
            d if d is not None else (old.dims[j] if old is not None else None)
            for j, d in enumerate(dims)
        ]
    )


def rename(out: ir.Value, dims: list[int | str], forgotten: list[ir.Value]) -> bool:
    """Give ``out`` the dims ``dims`` (proved by its producer) and forget the shapes onnx's
    inference derived downstream from the unnamed dims (named ``unk__*``, appended to
    ``forgotten``), so that the next inference names them too. False when there is nothing to
    do."""
    if any(isinstance(d, str) and "unk__" in d and not d.startswith("unk__") for d in dims):
        # a sum or multiple of a dim inference could not compute: a later run may compute
        # that dim, and a name built on its placeholder would outlive it
        return False
    current = u.symbolic_dims(out)
    if current == dims:
        return False  # a graph output too: the optimizer gives it back its declared names
    if current is not None and (
        len(current) != len(dims)
        or any(isinstance(c, int) and c != d for c, d in zip(current, dims, strict=True))
    ):
        return False  # conflicting facts: leave the value alone
    out.shape = ir.Shape(dims)
    pending, seen = [out], {id(out)}
    while pending:
        value = pending.pop()
        for user, _ in value.uses():
            for o in user.outputs:
                if id(o) in seen:
                    continue
                seen.add(id(o))
                found = u.symbolic_dims(o)
                if _carry(user, o, found):
                    pending.append(o)  # computed here: no inference round needed for it
                    continue
                if found is None:
                    continue
                if any(isinstance(d, str) and d.startswith("unk__") for d in found):
                    o.shape = None
                    pending.append(o)
                    forgotten.append(o)
    return True


def _unknown(d: int | str | None) -> bool:
    return d is None or (isinstance(d, str) and d.startswith("unk__"))


def _broadcast(a: int | str | None, b: int | str | None) -> int | str | None:
    """One dim of a valid broadcast: equal dims, the other side of a 1, and a static size over
    a name (which must then be that size or 1); ``None`` where the operands do not decide it."""
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    if isinstance(a, int) and not isinstance(b, int):
        return a
    if isinstance(b, int) and not isinstance(a, int):
        return b
    return None


def _broadcast_all(shapes: list[list[int | str | None]]) -> list[int | str | None] | None:
    rank = max(len(s) for s in shapes)
    out: list[int | str | None] = []
    for j in range(rank):
        d: int | str | None = 1
        for s in shapes:
            k = j - (rank - len(s))
            d = _broadcast(d, s[k] if k >= 0 else 1)
            if d is None:
                return None
        out.append(d)
    return out


_SAME_SHAPE = u._SHAPE_KEEPING - {"LayerNormalization", "RMSNormalization", "Dropout"}
BROADCASTING = u._ELEMENTWISE | {"Where", "Equal", "Less", "Greater", "LessOrEqual",
                                 "GreaterOrEqual", "And", "Or", "Xor", "Mod", "PRelu"}  # fmt: skip


def _local_dims(node: ir.Node, o: ir.Value) -> list[int | str | None] | None:
    """``o``'s dims as the op computes them from its inputs' (ops that keep, permute or
    broadcast shapes, and MatMul); ``None`` for any other op or an unknown input rank."""
    if not u.is_standard(node) or any(v is None for v in node.inputs) or not node.inputs:
        return None
    op = node.op_type
    found = [named(v) for v in node.inputs]
    ins = [d for d in found if d is not None]
    if len(ins) != len(found):
        return None
    first = ins[0]
    if op in _SAME_SHAPE or (
        op in ("LayerNormalization", "RMSNormalization", "Dropout") and o is node.outputs[0]
    ):
        return list(first)
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", None)
        perm = list(range(len(first)))[::-1] if perm is None else list(perm)
        if sorted(perm) != list(range(len(first))):
            return None
        return [first[p] for p in perm]
    if op in BROADCASTING:
        return _broadcast_all(ins)
    if op == "Tile":
        return tiled(node)
    if op == "MatMul" and len(ins) == 2:
        a, b = ins
        if len(a) < 2 or len(b) < 2:
            return None
        batch = _broadcast_all([a[:-2], b[:-2]])
        return None if batch is None else [*batch, a[-2], b[-1]]
    return None


def tiled(node: ir.Node) -> list[int | str | None] | None:
    """The dims of ``Tile(x, r)`` for constant repeats ``r``: each of x's dims times its repeat
    (``None`` where x's dim is unknown)."""
    from graphtrim.graph.passes import _dim_exprs as x

    if len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    dims, reps = named(node.inputs[0]), u.const_ints(node.inputs[1])
    if dims is None or reps is None or len(reps) != len(dims) or any(r < 0 for r in reps):
        return None
    out: list[int | str | None] = []
    for d, r in zip(dims, reps, strict=True):
        if r == 0:
            out.append(0)
        elif d is None or _unknown(d):
            out.append(None)
        else:
            out.append(x.scale(d, r))
    return out


def _carry(node: ir.Node, o: ir.Value, found: list[int | str | None] | None) -> bool:
    """Give ``o`` the dims its op computes from its inputs where they name what ``o`` has
    unnamed; whether ``o`` changed. Dims ``o`` already has (sizes, names) are kept."""
    new = _local_dims(node, o)
    if new is None or (found is not None and len(found) != len(new)):
        return False
    dims: list[int | str | None] = []
    for j, d in enumerate(new):
        old = found[j] if found is not None else None
        if not _unknown(old):
            if isinstance(old, int) and isinstance(d, int) and old != d:
                return False  # conflicting facts: leave the value alone
            dims.append(old)
        else:
            dims.append(None if _unknown(d) else d)
    if found is not None and dims == found:
        return False
    if found is None and all(d is None for d in dims):
        return False
    current = o.shape.dims if o.shape is not None else None
    o.shape = ir.Shape(
        [
            d if d is not None else (current[j] if current is not None else None)
            for j, d in enumerate(dims)
        ]
    )
    return True


def same(entry: Entry, dim: int | str | None) -> bool:
    return isinstance(entry, Dim) and dim is not None and entry.value == dim


def proves(entry: Entry, dim: int | str | None) -> bool:
    """``entry`` is provably ``dim``: the same static size (not 0: Reshape may read it as "copy")
    or the same named dim."""
    if isinstance(entry, int):
        return entry > 0 and entry == dim
    return same(entry, dim)
