"""The dims of the values that ``symbolic-shapes`` names where onnx's inference leaves them
unnamed: ``Range(0, d, 1)`` has length ``d``, ``ConstantOfShape(s)`` the dims ``s`` says, a
Concat the sum of its inputs' dims on its axis (a sum of names is named by its terms), a Tile,
a Slice, a Reshape and an Expand the dims their shape inputs prove."""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._symbolic_dims import (
    Dim,
    Entry,
    named,
    rename,
    shape_entries,
)


def computed_shape(node: ir.Node) -> list[Entry] | None:
    """The entries of a Reshape's or Expand's shape input when it is computed (not a constant)."""
    if len(node.inputs) < 2 or node.inputs[1] is None or u.is_constant(node.inputs[1]):
        return None
    return shape_entries(node.inputs[1])


def name_range(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``Range(0, d, 1)`` for a dim ``d`` read from a tensor has that dim's length."""
    if len(node.inputs) != 3 or u.const_ints(node.inputs[0]) != [0]:
        return False
    if u.const_ints(node.inputs[2]) != [1]:
        return False
    limit = shape_entries(node.inputs[1]) if node.inputs[1] is not None else None
    if limit is None or len(limit) != 1 or not isinstance(limit[0], Dim):
        return False
    return rename(node.outputs[0], [limit[0].value], forgotten)


def name_fill(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``ConstantOfShape(s)`` has the shape ``s`` says, dim by dim."""
    entries = shape_entries(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
    if entries is None:
        return False
    dims: list[int | str] = []
    for e in entries:
        if isinstance(e, Dim):
            dims.append(e.value)
        elif isinstance(e, int) and e >= 0:
            dims.append(e)
        else:
            return False
    return rename(node.outputs[0], dims, forgotten)


def name_concat(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``Concat(x1, x2, .., axis)`` has the sum of their dims on the axis (a sum of names is
    named by its terms: a KV cache's ``past`` and one new token make ``(past+1)``) and
    their common dims elsewhere."""
    from graphtrim.graph.passes import _dim_exprs as x

    parts = [named(v) for v in node.inputs]
    if not parts or any(p is None for p in parts):
        return False
    rank = len(parts[0])  # type: ignore[arg-type]
    if any(len(p) != rank for p in parts):  # type: ignore[arg-type]
        return False
    axis = node.attributes.get_int("axis", 0)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return False
    dims: list[int | str] = []
    for j in range(rank):
        column = [p[j] for p in parts]  # type: ignore[index]
        if j == axis:
            if any(d is None for d in column):
                return False
            total: int | str = 0
            for d in column:
                total = x.add(total, d)  # type: ignore[arg-type]
            dims.append(total)
        else:
            known = {d for d in column if d is not None}
            if len(known) != 1:
                return False  # unknown everywhere, or two names nothing relates
            dims.append(known.pop())
    return rename(node.outputs[0], dims, forgotten)


def name_tile(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``Tile(x, r)`` with constant repeats has x's dims times them (onnx's inference
    cannot name a multiple of a named dim)."""
    from graphtrim.graph.passes._symbolic_dims import tiled

    dims = tiled(node)
    if dims is None or any(d is None for d in dims):
        return False
    return rename(node.outputs[0], dims, forgotten)  # type: ignore[arg-type]


def name_slice(node: ir.Node, forgotten: list[ir.Value], opset: int) -> bool:
    """``Slice(x, starts, ends, axes, steps)`` keeps x's dims on the axes it does not slice
    (onnx's inference gives none when a parameter is computed, as position ids sliced to
    the sequence length are); on a sliced axis, constant parameters leave a computable
    size of a static dim, and ``[0:INT_MAX:1]`` keeps the dim. A dim neither proves keeps
    the name inference gave it, if any.

    Only a constant table is named: a slice of a computed tensor (a channel split) already
    has the dims onnx's inference gives, and each renaming costs another round of it."""
    if opset < 10 or len(node.inputs) < 3 or not u.is_constant(node.inputs[0]):
        return False
    x_dims = named(node.inputs[0])
    if x_dims is None:
        return False
    rank = len(x_dims)
    axes_v = node.inputs[3] if len(node.inputs) > 3 else None
    if axes_v is not None:
        axes = u.const_ints(axes_v)
    else:
        count = u.static_shape(node.inputs[1])
        axes = list(range(count[0])) if count is not None and len(count) == 1 else None
    norm = u.normalize_axes(axes, rank) if axes is not None else None
    if norm is None or len(set(norm)) != len(norm):
        return False
    starts, ends = u.const_ints(node.inputs[1]), u.const_ints(node.inputs[2])
    steps_v = node.inputs[4] if len(node.inputs) > 4 else None
    steps = u.const_ints(steps_v) if steps_v is not None else [1] * len(norm)
    current = named(node.outputs[0])
    if current is not None and len(current) != rank:
        return False
    dims: list[int | str] = []
    for j in range(rank):
        d = x_dims[j]
        size: int | str | None = None
        if j not in norm:
            size = d
        else:
            k = norm.index(j)
            whole = starts is not None and ends is not None and steps is not None
            if whole and isinstance(d, int):
                size = len(range(*slice(starts[k], ends[k], steps[k]).indices(d)))  # type: ignore[index]
            elif whole and starts[k] == 0 and steps[k] == 1 and ends[k] >= 2**31 - 1:  # type: ignore[index]
                size = d
        if size is None and current is not None:
            size = current[j]
        if size is None:
            return False
        dims.append(size)
    return rename(node.outputs[0], dims, forgotten)


def name_reshape(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``Reshape(x, s)`` (allowzero 0) has the dims ``s`` says entry by entry: a size, a dim
    read from a tensor, 0 copying x's dim, and a -1 that is what the element count leaves
    (the product of x's dims over the other entries', computed when that is a whole size or
    one name times one: :func:`._dim_exprs.quotient`). With ``allowzero=1`` and no literal
    0 entry (torch's dynamo exporter writes it so) the entries mean the same."""
    from graphtrim.graph.passes import _dim_exprs as x

    allowzero = node.attributes.get_int("allowzero", 0)
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    target = u.const_ints(node.inputs[1])
    entries: list[Entry] | None = list(target) if target is not None else None
    if entries is None:
        entries = shape_entries(node.inputs[1])
    x_dims = named(node.inputs[0])
    if entries is None or x_dims is None or entries.count(-1) > 1:
        return False
    if allowzero and 0 in entries:
        return False  # a literal 0 is a zero-sized dim there, not a copy
    if any(d is None for d in x_dims):
        return False
    dims: list[int | str | None] = []
    for j, e in enumerate(entries):
        t = e.value if isinstance(e, Dim) else e
        if t is None or (isinstance(e, Dim) and t == 0):
            return False  # unknown, or a size 0 read at run time (Reshape copies then)
        if t == 0:
            if j >= len(x_dims):
                return False
            t = x_dims[j]
        dims.append(None if t == -1 else t)
    if None in dims:
        # the -1 is x's element count over the other entries, where that is a size or a
        # dim name for every value of the names: (128*batch) x 16 elements over 32 x 16 x 4
        # leave batch
        rest = x.quotient(
            x.product(x_dims),  # type: ignore[arg-type]
            x.product([d for d in dims if d is not None]),
        )
        if rest is None:
            return False
        dims[dims.index(None)] = rest
    return rename(node.outputs[0], [d for d in dims if d is not None], forgotten)


def name_expand(node: ir.Node, forgotten: list[ir.Value]) -> bool:
    """``Expand(x, s)`` has the broadcast of x's dims and the entries of ``s``, dim by dim
    (right-aligned), where each is decided: an entry or dim of 1 takes the other side."""
    entries = computed_shape(node)
    x_dims = named(node.inputs[0])
    if entries is None or x_dims is None or len(entries) < len(x_dims):
        return False
    offset = len(entries) - len(x_dims)
    dims: list[int | str] = []
    for j, e in enumerate(entries):
        xd: int | str | None = x_dims[j - offset] if j >= offset else 1
        ev = e.value if isinstance(e, Dim) else e
        takes_entry = ev is not None and (
            (xd == 1 and (not isinstance(ev, int) or ev >= 0)) or ev == xd
        )
        if ev == 1 and xd is not None:
            dims.append(xd)
        elif takes_entry:
            assert ev is not None
            dims.append(ev)
        else:
            return False
    return rename(node.outputs[0], dims, forgotten)
