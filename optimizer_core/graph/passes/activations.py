"""Redundant activations.

Rules (exact for non-NaN inputs):

- ``Relu(Relu(x)) -> Relu(x)``; more generally ``Relu(y) -> y`` when ``y`` is already
  non-negative: produced by Relu, Sigmoid, Softmax, Abs, Exp, Softplus, or Clip/Max with a
  lower bound >= 0.
- ``Clip(y, lo, hi) -> y`` when ``lo <= 0`` and there is no upper bound, for non-negative ``y``
  (a Clip with lo <= 0 cannot change a non-negative value).
- ``Clip(Relu(x), lo >= 0, hi) -> Clip(x, lo, hi)``: the Clip already clamps below at lo.
- ``Clip(Clip(x, a1, b1), a2, b2) -> Clip(x, max(a1, a2), min(b1, b2))`` when the intervals
  overlap (``max(a1, a2) <= min(b1, b2)``) and the inner Clip has no other reader.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass, replace_output, reroute_refusal

_NON_NEGATIVE_OPS = frozenset({"Relu", "Sigmoid", "Softmax", "Abs", "Exp", "Softplus"})


def _clip_bounds(node: ir.Node, model: ir.Model) -> tuple[float | None, float | None] | None:
    """(lo, hi) of a Clip, None for an absent bound; None when a bound is not constant."""
    if u.node_opset(node, model) < 11:
        lo = node.attributes.get_float("min", None)
        hi = node.attributes.get_float("max", None)
        return lo, hi
    bounds: list[float | None] = []
    for i in (1, 2):
        v = node.inputs[i] if len(node.inputs) > i else None
        if v is None:
            bounds.append(None)
            continue
        arr = u.const_array(v)
        if arr is None or arr.size != 1:
            return None
        bounds.append(float(arr.reshape(-1)[0]))
    return bounds[0], bounds[1]


def is_non_negative(value: ir.Value, model: ir.Model) -> bool:
    node = value.producer()
    if node is None or not u.is_standard(node):
        arr = u.const_array(value)
        return (
            arr is not None and arr.dtype.kind in "fiu" and arr.size > 0 and bool(np.all(arr >= 0))
        )
    if node.op_type in _NON_NEGATIVE_OPS:
        return True
    if node.op_type == "Clip":
        b = _clip_bounds(node, model)
        return b is not None and b[0] is not None and b[0] >= 0
    return False


def _relu_after_non_negative(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    x = node.inputs[0]
    if x is None or not is_non_negative(x, ctx.model):
        return "the input may be negative"
    return reroute_refusal(node.outputs[0], x) or x


Bounds = tuple[ir.Value, float | None, float | None]


def _clip(node: ir.Node, ctx: RuleContext) -> Bounds | str:
    x = node.inputs[0]
    bounds = _clip_bounds(node, ctx.model)
    if x is None or bounds is None:
        return "a bound is not a constant scalar"
    return x, bounds[0], bounds[1]


def _keeps_non_negative(x: ir.Value, lo: float | None, hi: float | None, model: ir.Model) -> bool:
    """A Clip with no upper bound and ``lo <= 0`` cannot change its non-negative input."""
    return hi is None and (lo is None or lo <= 0) and is_non_negative(x, model)


def _clip_after_non_negative(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    clip = _clip(node, ctx)
    if isinstance(clip, str):
        return clip
    x, lo, hi = clip
    if not _keeps_non_negative(x, lo, hi, ctx.model):
        return "the Clip may change its input"
    return reroute_refusal(node.outputs[0], x) or x


def _clip_of(op: str, node: ir.Node, ctx: RuleContext) -> tuple[Bounds, ir.Node] | str:
    """The Clip's input, bounds and the ``op`` node producing its input (read only there)."""
    clip = _clip(node, ctx)
    if isinstance(clip, str):
        return clip
    x, lo, hi = clip
    if _keeps_non_negative(x, lo, hi, ctx.model):
        return "the Clip cannot change its input, whose readers cannot be rerouted"
    producer = x.producer()
    if producer is None or not u.single_consumer(x):
        return "the input is not computed for the Clip alone"
    if not u.is_op(producer, op):
        return f"the input is not produced by {op}"
    return clip, producer


def _relu_into_clip(node: ir.Node, ctx: RuleContext) -> ir.Value | str:
    found = _clip_of("Relu", node, ctx)
    if isinstance(found, str):
        return found
    (_, lo, _), relu = found
    if lo is None or lo < 0 or relu.inputs[0] is None:
        return "the Clip's lower bound is not >= 0"
    return relu.inputs[0]


def _read_source(node: ir.Node, src: ir.Value, ctx: RuleContext) -> None:
    node.replace_input_with(0, src)


Merged = tuple[ir.Value, float | None, float | None, np.dtype]


def _clip_clip(node: ir.Node, ctx: RuleContext) -> Merged | str:
    found = _clip_of("Clip", node, ctx)
    if isinstance(found, str):
        return found
    (x, lo, hi), producer = found
    if u.node_opset(node, ctx.model) < 11:
        return "bounds are attributes (opset < 11)"
    inner = _clip_bounds(producer, ctx.model)
    if inner is None or producer.inputs[0] is None:
        return "an inner bound is not a constant scalar"
    los = [b for b in (lo, inner[0]) if b is not None]
    his = [b for b in (hi, inner[1]) if b is not None]
    new_lo = max(los) if los else None
    new_hi = min(his) if his else None
    if new_lo is not None and new_hi is not None and new_lo > new_hi:
        return "the intervals do not overlap"
    if x.dtype is not None:
        dtype = x.dtype.numpy()
    else:  # type unknown (e.g. after a custom op): the bounds have the data's type
        bound_arrays = [u.const_array(v) for n in (node, producer) for v in n.inputs[1:]]
        dtype = next((a.dtype for a in bound_arrays if a is not None), np.dtype(np.float32))
    return producer.inputs[0], new_lo, new_hi, dtype


def _merge_clips(node: ir.Node, match: Merged, ctx: RuleContext) -> None:
    src, new_lo, new_hi, dtype = match
    namer = u.NameGenerator(ctx.model) if (new_lo is not None or new_hi is not None) else None
    inputs: list[ir.Value | None] = [src]
    for bound, tag in ((new_lo, "min"), (new_hi, "max")):
        if bound is None:
            inputs.append(None)
        else:
            assert namer is not None
            inputs.append(
                u.add_initializer(
                    ctx.graph, np.array(bound, dtype=dtype), namer(f"{node.name or 'clip'}_{tag}")
                )
            )
    while inputs and inputs[-1] is None:
        inputs.pop()
    for i in range(len(node.inputs)):
        node.replace_input_with(i, None)
    node.resize_inputs(len(inputs))
    for i, v in enumerate(inputs):
        node.replace_input_with(i, v)


_NON_NEGATIVE = (
    "y non-negative: made by Relu/Sigmoid/Softmax/Abs/Exp/Softplus, by a Clip with lo >= 0, or "
    "a constant >= 0"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "relu-after-non-negative",
        f"Relu(y) -> y for {_NON_NEGATIVE}",
        ("Relu",),
        _relu_after_non_negative,
        replace_output,
    ),
    Rule(
        "clip-after-non-negative",
        f"Clip(y, lo, none) -> y when lo <= 0 (or absent), for {_NON_NEGATIVE}",
        ("Clip",),
        _clip_after_non_negative,
        replace_output,
    ),
    Rule(
        "relu-into-clip",
        "Clip(Relu(x), lo, hi) -> Clip(x, lo, hi) when lo >= 0 and the Relu has no other reader",
        ("Clip",),
        _relu_into_clip,
        _read_source,
    ),
    Rule(
        "clip-clip",
        "Clip(Clip(x, a1, b1), a2, b2) -> Clip(x, max(a1, a2), min(b1, b2)) when the intervals "
        "overlap and the inner Clip has no other reader (opset 11+)",
        ("Clip",),
        _clip_clip,
        _merge_clips,
    ),
)


class RedundantActivations(RulePass):
    name = "activations"
    summary = "remove Relu/Clip that cannot change their input; merge nested Clips"
    rules = RULES
