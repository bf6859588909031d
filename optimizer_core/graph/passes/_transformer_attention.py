"""The attention fusion of pass ``fuse-transformer``: ``Softmax(Q @ K^T * scale [+ mask]) @ V``
on rank-4 ``[batch, heads, seq, head]`` values -> ``Attention(Q, K, V, mask, scale=scale)``
(opset 23).

Decoders add three things around that core, each folded into the one op where present:

- a KV cache: ``K = Concat(past_key, K_new, axis=2)`` (likewise V) becomes the op's
  ``past_key`` / ``past_value`` inputs, and its ``present_key`` / ``present_value`` outputs
  (the same concatenation) replace the Concat's value, a graph output of the model;
- grouped-query attention: K and V repeated to the query heads as
  ``Reshape(Expand(Unsqueeze(K, 2), [B, Hk, n, T, D]), [B, Hk * n, T, D])`` (transformers'
  ``repeat_kv``) are passed unrepeated: the op gives query head ``i`` key/value head
  ``i // n``, the order of that repeat. Every shape entry must be proved (a static size or
  the named dim it stands for);
- a guard on fully masked rows, ``Where(IsNaN(p), 0, p)`` (torch's exporter writes it for
  scaled dot-product attention): the op gives such a row zeros (ONNX's erratum to Attention-23),
  the guard's result. The guard also zeroes a row made NaN by a NaN or an overflowing score,
  where the op's row stays NaN: the fusion assumes finite scores.

onnxruntime's CPU kernel reads a mask entry of exactly ``-FLT_MAX`` as "masked" and gives a
row masked that way throughout zeros, where the decomposed form (and the spec, for a float
mask) gives the mean of V. The fused op's mask therefore holds the next float toward zero
wherever the mask held ``-FLT_MAX`` (:func:`_fill_fixed`): every partly masked row is unchanged
(that entry's exponent underflows to 0 either way) and a fully masked one is the mean of V in
both. transformers writes its padding and causal mask as ``Where(c, 0, -FLT_MAX)``; eager BERT
as ``(1 - m) * -FLT_MAX``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes._symbolic_dims import named, proves, shape_entries
from graphtrim.graph.passes._transformer_common import (
    elem_type,
    fusion,
    private,
    producer,
    scalar,
    sole_reader,
    split_const,
)
from graphtrim.graph.rules import RuleContext, replace
from graphtrim.graph.targets import emits_allowed


def _scaled(value: ir.Value | None) -> tuple[ir.Value | None, float, list[ir.Node]]:
    """``(x, c, nodes)`` when ``value`` is ``x * c`` (or ``x / (1/c)``) for a scalar ``c``,
    else ``(value, 1.0, [])``."""
    node = producer(value, "Mul", "Div")
    split = split_const(node) if node is not None else None
    if node is None or split is None or value is None or len(value.uses()) != 1:
        return value, 1.0, []
    c = scalar(split[1])
    if c is None or c == 0.0:
        return value, 1.0, []
    return split[0], (c if node.op_type == "Mul" else 1.0 / c), [node]


def _mask_fits(mask: ir.Value, q: ir.Value, k_seq: int | str | None) -> bool:
    """onnxruntime's Attention broadcasts a mask over batch and heads only: its last two
    dims must be the query and key lengths (provably, by static size or dim name)."""
    md, qd = u.symbolic_dims(mask), u.symbolic_dims(q)
    if md is None or qd is None or not 2 <= len(md) <= 4:
        return False
    return all(m is not None and m == want for m, want in ((md[-2], qd[2]), (md[-1], k_seq)))


def _guard(p: ir.Value) -> list[ir.Node]:
    """``[IsNaN, Where]`` when the probabilities ``p`` are read only as
    ``Where(IsNaN(p), 0, p)``, else ``[]``."""
    uses = list(p.uses())
    if p.is_graph_output() or len(uses) != 2:
        return []
    isnan = next((n for n, _ in uses if u.is_op(n, "IsNaN")), None)
    if isnan is None:
        return []
    where = sole_reader(isnan.outputs[0], "Where")
    if (
        where is None
        or len(where.inputs) != 3
        or where.inputs[0] is not isnan.outputs[0]
        or where.inputs[2] is not p
        or not u.is_all(where.inputs[1], 0.0)
        or u.rank(where.inputs[1]) not in (0, 1)
        or {id(n) for n, _ in uses} != {id(isnan), id(where)}
    ):
        return []
    return [isnan, where]


@dataclasses.dataclass
class _Repeat:
    source: ir.Value  # [B, Hk, T, D], before the repeat
    times: int
    nodes: list[ir.Node]


def _concat_seq(value: ir.Value) -> int | str | None:
    """The key length of a K or V ``[B, H, T, D]``: its named dim, or for a KV cache's
    ``Concat(past, new, axis=2)`` the sum of the parts' (a graph output's declared name may
    spell the sum otherwise)."""
    from graphtrim.graph.passes import _dim_exprs as x

    cached = _cached(value)
    if cached is not None:
        pd, nd = named(cached[0]), named(cached[1])
        if pd is None or nd is None or pd[2] is None or nd[2] is None:
            return None
        return x.add(pd[2], nd[2])
    d = named(value)
    return d[2] if d is not None and len(d) == 4 else None


def _cached(value: ir.Value | None) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """``(past, new, concat)`` when ``value`` is ``Concat(past, new)`` of rank-4 values on
    axis 2."""
    node = producer(value, "Concat")
    if node is None or len(node.inputs) != 2 or None in node.inputs:
        return None
    past, new = node.inputs
    if u.rank(past) != 4 or u.rank(new) != 4 or node.attributes.get_int("axis", 0) not in (2, -2):
        return None
    return past, new, node  # type: ignore[return-value]


def _repeated(value: ir.Value | None) -> _Repeat | str | None:
    """The ``repeat_kv`` of ``value`` (see the module's doc), ``None`` when ``value`` is not
    reshaped from an Expand, a reason when it is but nothing proves the repeat."""
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape is not None else None
    unsq = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if reshape is None or expand is None or unsq is None or value is None:
        return None
    if len(unsq.inputs) < 2 or u.const_ints(unsq.inputs[1]) != [2] or u.rank(unsq.inputs[0]) != 4:
        return "the repeat does not unsqueeze a rank-4 K or V at axis 2"
    src = unsq.inputs[0]
    d = named(src)
    if d is None or src is None:
        return "the repeated K or V has no shape"
    seq = _concat_seq(src)
    b, hk, dh = d[0], d[1], d[3]
    grown = shape_entries(expand.inputs[1])
    target = shape_entries(reshape.inputs[1])
    if grown is None or target is None or len(grown) != 5 or len(target) != 4:
        return "the repeat's shapes are not known entry by entry"
    times = grown[2]
    if not isinstance(times, int) or times < 1 or not isinstance(hk, int):
        return "the repeat count or the key/value heads are not static"
    for entry, dim in zip((grown[0], grown[1], grown[3], grown[4]), (b, hk, seq, dh), strict=True):
        if entry != 1 and not proves(entry, dim):
            return "an Expand entry is not provably 1 or the dim it broadcasts"
    allowzero = reshape.attributes.get_int("allowzero", 0)
    if target.count(-1) > 1:
        return "the Reshape infers more than one entry"
    for j, (entry, dim) in enumerate(zip(target, (b, hk * times, seq, dh), strict=True)):
        if proves(entry, dim) or (entry == 0 and not allowzero and j != 1) or entry == -1:
            # a 0 copies the Expand's own dim at that position, which is ``dim``; the one -1
            # is the element count over the other entries, all proved: ``dim`` again
            continue
        return "a Reshape entry is not provably [B, Hk * n, T, D]"
    nodes = [unsq, expand, reshape]
    if not private(nodes, keep=value):
        return "the repeat is read outside the pattern"
    return _Repeat(src, times, nodes)


@dataclasses.dataclass
class Attention:
    q: ir.Value
    k: ir.Value
    v: ir.Value
    mask: ir.Value | None
    k_perm: list[int] | None  # K's layout is [batch, seq, heads, head]: move heads forward
    scale: float
    out_mm: ir.Node  # the final MatMul (the fused op goes before it)
    # a KV cache: (past_key, past_value, Concat of K, Concat of V)
    cache: tuple[ir.Value, ir.Value, ir.Node, ir.Node] | None = None


def check_attention(softmax: ir.Node, ctx: RuleContext) -> Attention | str:
    if fusion(ctx).opset < 23 or not emits_allowed(ctx.options.target, "Attention"):
        return "Attention needs opset 23 and a target that takes it"
    x = softmax.inputs[0]
    axis = softmax.attributes.get_int("axis", -1)
    if x is None or u.rank(x) != 4 or axis not in (-1, 3):
        return "not a Softmax over the last axis of a rank-4 value"
    p = softmax.outputs[0]
    guard = _guard(p)
    probs = guard[-1].outputs[0] if guard else p
    out_mm = sole_reader(probs, "MatMul")
    if out_mm is None or out_mm.inputs[0] is not probs:
        return "the probabilities are not the left operand of a MatMul reading them alone"
    v = out_mm.inputs[1]
    nodes: list[ir.Node] = [softmax, *guard, out_mm]
    mask = None
    scores: ir.Value | None = x
    add = producer(x, "Add")
    if add is not None and len(x.uses()) == 1:
        a, b = add.inputs
        mm_side = a if producer(a, "MatMul", "Mul", "Div") is not None else b
        mask = b if mm_side is a else a
        if mask is None or mm_side is None or producer(mask, "MatMul") is not None:
            return "the mask is missing or a product"
        scores, nodes = mm_side, [*nodes, add]
    scores, post, post_nodes = _scaled(scores)
    mm = producer(scores, "MatMul")
    if mm is None or scores is None or len(scores.uses()) != 1:
        return "the scores are not a MatMul read once"
    q, q_scale, q_nodes = _scaled(mm.inputs[0])
    kt, k_scale, k_nodes = _scaled(mm.inputs[1])
    trans = producer(kt, "Transpose")
    if trans is None or kt is None or len(kt.uses()) != 1:
        return "K is not transposed by a Transpose read once"
    perm = list(trans.attributes.get_ints("perm", []))
    k_src = trans.inputs[0]
    if perm == [0, 1, 3, 2]:
        k_perm = None  # K is [batch, heads, seq, head] already
    elif perm == [0, 2, 3, 1]:
        k_perm = [0, 2, 1, 3]  # K is [batch, seq, heads, head]: move heads forward
    else:
        return "K's transpose is not [0, 1, 3, 2] or [0, 2, 3, 1]"
    if any(u.rank(t) != 4 for t in (q, k_src, v)) or q is None or k_src is None or v is None:
        return "Q, K or V is not rank 4"
    repeats = [_repeated(k_src) if k_perm is None else None, _repeated(v)]
    for r in repeats:
        if isinstance(r, str):
            return r
    rk, rv = repeats
    repeat_nodes: list[ir.Node] = []
    if rk is not None or rv is not None:
        if not isinstance(rk, _Repeat) or not isinstance(rv, _Repeat) or rk.times != rv.times:
            return "K and V are not repeated alike"
        qd, kd = named(q), named(rk.source)
        if qd is None or kd is None or not isinstance(kd[1], int) or qd[1] != kd[1] * rk.times:
            return "the query heads are not provably the key/value heads times the repeat"
        k_src, v, repeat_nodes = rk.source, rv.source, [*rk.nodes, *rv.nodes]
    if not all(elem_type(t) == ir.DataType.FLOAT for t in (q, k_src, v)):
        return "Q, K or V is not float"
    if mask is not None and elem_type(mask) not in (ir.DataType.FLOAT, ir.DataType.BOOL):
        return "the mask is not float or bool"
    if k_perm is not None:
        kd = u.symbolic_dims(k_src)
        k_seq = kd[1] if kd is not None else None
    else:
        k_seq = _concat_seq(k_src)
    if mask is not None and not _mask_fits(mask, q, k_seq):
        return "the mask's last two dims are not provably the query and key lengths"
    if guard and _mask_unknown(mask):
        return "a guarded pattern's float mask has no known masked value"
    pattern = [*nodes, *post_nodes, mm, *q_nodes, *k_nodes, trans, *repeat_nodes]
    if not private(pattern, keep=out_mm.outputs[0]):
        return "an intermediate value is read outside the pattern"
    cache = None
    ck, cv = (_cached(k_src), _cached(v)) if k_perm is None else (None, None)
    if ck is not None and cv is not None and _cache_readers_ok([ck[2], cv[2]], pattern):
        cache = (ck[0], cv[0], ck[2], cv[2])
        k_src, v = ck[1], cv[1]
    return Attention(q, k_src, v, mask, k_perm, post * q_scale * k_scale, out_mm, cache)


def _cache_readers_ok(concats: list[ir.Node], pattern: list[ir.Node]) -> bool:
    """The Concats' values may be replaced by the op's present outputs: besides the pattern,
    only graph outputs read them (a reader elsewhere might come before the fused op)."""
    ids = {id(n) for n in pattern}
    return all(id(user) in ids for c in concats for user, _ in c.outputs[0].uses())


_LOWEST = np.float32(np.finfo(np.float32).min)
_ABOVE_LOWEST = np.nextafter(_LOWEST, np.float32(0))


def _constant_fill(mask: ir.Value) -> np.ndarray | None:
    """The fill of a ``Where(c, a, fill)`` mask with a constant scalar fill, else None."""
    node = producer(mask, "Where")
    if node is None or len(node.inputs) != 3 or node.inputs[2] is None:
        return None
    fill = u.const_array(node.inputs[2])
    return fill if fill is not None and fill.size == 1 else None


def _mask_unknown(mask: ir.Value | None) -> bool:
    """A float mask whose masked value is not known: neither a Where with a constant fill nor a
    constant. Under the fully-masked-row guard it is not fused: an entry of -inf gives such a
    row zeros in both forms, one of -FLT_MAX zeros in onnxruntime's kernel and the mean of V in
    the decomposed form, and no rewrite of the mask keeps both."""
    return (
        mask is not None
        and elem_type(mask) == ir.DataType.FLOAT
        and _constant_fill(mask) is None
        and u.const_array(mask) is None
    )


def _fill_fixed(mask: ir.Value, ctx: RuleContext, before: ir.Node) -> ir.Value:
    """``mask`` as the fused op gets it, past onnxruntime's reading of ``-FLT_MAX`` (see the
    module's doc); one per mask, shared by every layer:

    - ``Where(c, a, -FLT_MAX)``: the same Where with the next float toward 0 as its fill;
    - a constant: its ``-FLT_MAX`` entries replaced by that float;
    - any other float mask (a pattern without the guard): ``Max(mask, that float)``. An entry
      of -inf becomes finite too: a row masked by -inf throughout was NaN in the decomposed
      form and is the mean of V now.
    """
    if elem_type(mask) != ir.DataType.FLOAT:
        return mask
    made = fusion(ctx).fixed_masks
    if id(mask) in made:
        return made[id(mask)]
    node = producer(mask, "Where")
    fill = _constant_fill(mask)
    namer = fusion(ctx).new_name
    if fill is not None:
        if fill.dtype != np.float32 or fill.reshape(-1)[0] != _LOWEST or node is None:
            return mask
        owner = node.graph if node.graph is not None else ctx.graph  # an enclosing graph's too
        const = u.add_initializer(
            owner, np.array(_ABOVE_LOWEST, dtype=np.float32).reshape(fill.shape), namer("mask_fill")
        )
        fixed = ir.Node("", "Where", [node.inputs[0], node.inputs[1], const], name=namer("Where"))
        owner.insert_after(node, fixed)
    else:
        arr = u.const_array(mask)
        if arr is not None:
            if not (arr == _LOWEST).any():
                return mask
            made[id(mask)] = u.add_initializer(
                ctx.graph, np.maximum(arr, _ABOVE_LOWEST).astype(np.float32), namer("mask")
            )
            return made[id(mask)]
        floor = u.add_initializer(ctx.graph, np.array(_ABOVE_LOWEST, np.float32), namer("floor"))
        fixed = ir.Node("", "Max", [mask, floor], name=namer("Max"))
        src = mask.producer()
        if src is not None and src.graph is ctx.graph:
            ctx.graph.insert_after(src, fixed)
        else:  # a graph input (or an enclosing graph's value): before its first fused reader
            ctx.graph.insert_before(before, fixed)
    fixed.outputs[0].shape = mask.shape
    fixed.outputs[0].type = mask.type
    made[id(mask)] = fixed.outputs[0]
    return made[id(mask)]


def fuse_attention(softmax: ir.Node, m: Attention, ctx: RuleContext) -> None:
    graph, out_mm = ctx.graph, m.out_mm
    y = out_mm.outputs[0]
    k_src = m.k
    if m.k_perm is not None:
        move = ir.Node("", "Transpose", [k_src], [ir.AttrInt64s("perm", m.k_perm)])
        graph.insert_before(out_mm, move)
        kd = u.symbolic_dims(k_src)
        if kd is not None:
            move.outputs[0].shape = ir.Shape([kd[i] for i in m.k_perm])
        move.outputs[0].type = k_src.type
        k_src = move.outputs[0]
    mask = _fill_fixed(m.mask, ctx, out_mm) if m.mask is not None else None
    inputs: list[ir.Value | None] = [m.q, k_src, m.v]
    if m.cache is not None:
        inputs += [mask, m.cache[0], m.cache[1]]  # an absent mask stays an empty input
    elif mask is not None:
        inputs.append(mask)
    fused = ir.Node(
        "",
        "Attention",
        inputs,
        [ir.AttrFloat32("scale", m.scale)],
        num_outputs=3 if m.cache is not None else 1,
        name=fusion(ctx).new_name("Attention"),
    )
    graph.insert_before(out_mm, fused)
    fused.outputs[0].shape = y.shape
    fused.outputs[0].type = y.type
    if m.cache is not None:
        for concat, present in zip(m.cache[2:], fused.outputs[1:], strict=True):
            old = concat.outputs[0]
            present.shape, present.type = old.shape, old.type
            replace(old, present, "a KV cache's Concat")
    replace(y, fused.outputs[0], "an attention pattern")
