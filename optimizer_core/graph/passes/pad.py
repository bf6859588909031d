"""Explicit zero padding folded into the padding of the node that reads it.

Rules (exact: the reader sees the same zeros, now as its own implicit padding):

- ``pad-conv``: ``Conv(Pad(x, pads), W, B)`` -> ``Conv(x, W, B)`` with the Pad's spatial pads
  added to the Conv's ``pads``.
- ``pad-avgpool``: the same into ``AveragePool`` with ``count_include_pad=1`` (its own padding
  then counts towards the divisor exactly as the Pad's zeros did) and ``ceil_mode=0`` (with
  ``ceil_mode`` a last window that starts in the end padding is dropped, a test that depends on
  the input's own extent), and only while every resulting pad stays smaller than the kernel
  (onnxruntime rejects larger pooling pads).

- ``pad-maxpool``: the same into ``MaxPool`` when the Pad's value is at most every value ``x``
  can hold (``x`` from a Relu, a Sigmoid or a Clip with a constant lower bound: its bound),
  ``ceil_mode=0``, every resulting pad below the kernel and the Indices output unread. MaxPool
  ignores its own padding; an explicit pad value ``v <= min(x)`` never wins a window that
  holds one element of ``x``, and with pads below the kernel and no ``ceil_mode`` every
  window holds one: the maxima are the same.

The Pad must be ``mode="constant"`` with a value of 0 (for MaxPool: at most ``x``'s bound) (absent, attribute or constant input), with
constant non-negative pads (attribute before opset 11, input after, optional ``axes`` input from
opset 18) that leave the batch and channel axes alone; its output must have no other reader and
not be a graph output, and the reader must use explicit pads (``auto_pad`` absent or ``NOTSET``).
ConvTranspose (whose pads crop the output) and every other reader are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass


def _pad_widths(pad: ir.Node, rank: int | None) -> list[int] | None:
    """The Pad's pads as ``[b_0, ..., b_{r-1}, e_0, ..., e_{r-1}]`` over every axis, or ``None``
    when they are not constant, malformed or the axes cannot be resolved."""
    for key in ("pads", "paddings"):  # "paddings" is Pad-1's name
        if key in pad.attributes:
            listed = [int(p) for p in pad.attributes[key].as_ints()]
            return listed if listed and len(listed) % 2 == 0 else None
    if len(pad.inputs) < 2 or pad.inputs[1] is None:
        return None
    pads = u.const_ints(pad.inputs[1])
    if pads is None or not pads or len(pads) % 2:
        return None
    axes_value = pad.inputs[3] if len(pad.inputs) > 3 else None
    if axes_value is None:
        return pads
    axes_raw = u.const_ints(axes_value)
    if axes_raw is None or rank is None or 2 * len(axes_raw) != len(pads):
        return None
    axes = u.normalize_axes(axes_raw, rank)
    if axes is None or len(set(axes)) != len(axes):
        return None
    n = len(axes)
    full = [0] * (2 * rank)
    for i, axis in enumerate(axes):
        full[axis] = pads[i]
        full[rank + axis] = pads[n + i]
    return full


def _pads_zero(pad: ir.Node) -> bool:
    """Pad fills with (a constant) zero."""
    if "value" in pad.attributes:
        return pad.attributes.get_float("value", 0.0) == 0.0
    value = pad.inputs[2] if len(pad.inputs) > 2 else None
    if value is None:
        return True
    arr = u.const_array(value)
    return arr is not None and arr.size == 1 and arr.dtype.kind in "fiu" and bool(np.all(arr == 0))


def _pad_value(pad: ir.Node) -> float | None:
    """The Pad's constant fill value (0 when absent), or ``None`` when not a constant."""
    if "value" in pad.attributes:
        return pad.attributes.get_float("value", 0.0)
    value = pad.inputs[2] if len(pad.inputs) > 2 else None
    if value is None:
        return 0.0
    arr = u.const_array(value)
    if arr is None or arr.size != 1 or arr.dtype.kind not in "fiu":
        return None
    return float(arr.reshape(-1)[0])


def _lower_bound(x: ir.Value) -> float | None:
    """A value no element of ``x`` is below: Relu and Sigmoid give 0, Clip its constant min."""
    node = x.producer()
    if u.is_op(node, "Relu", "Sigmoid"):
        return 0.0
    if u.is_op(node, "Clip") and node is not None:
        if "min" in node.attributes:  # before opset 11
            return node.attributes.get_float("min", float("-inf"))
        low = u.const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if low is not None and low.size == 1 and low.dtype.kind in "fiu":
            return float(low.reshape(-1)[0])
    return None


def _maxpool_ignores_pad(pad: ir.Node, pool: ir.Node) -> str | None:
    """Why the Pad's values could win a MaxPool window (None: they cannot)."""
    if pool.attributes.get_int("ceil_mode", 0) != 0:
        return "ceil_mode may start a window in the padding"
    indices = pool.outputs[1] if len(pool.outputs) > 1 else None
    if indices is not None and (indices.uses() or indices.is_graph_output()):
        return "the Indices output is read (it counts positions in the padded input)"
    value, x = _pad_value(pad), pad.inputs[0]
    bound = _lower_bound(x) if x is not None else None
    if value is None or bound is None or not value <= bound:
        return "the pad value may exceed a value of the input"
    return None


def _avgpool_counts_pads(pool: ir.Node) -> bool:
    return (
        pool.attributes.get_int("count_include_pad", 0) == 1
        and pool.attributes.get_int("ceil_mode", 0) == 0
    )


Fold = tuple[ir.Node, ir.Value, list[int]]  # the reader, the Pad's input, the reader's new pads


def _fold(pad: ir.Node, reader: ir.Node) -> Fold | str:
    """The reader's pads with the Pad's spatial pads added."""
    x = pad.inputs[0]
    if x is None or pad.attributes.get_string("mode", "constant") != "constant":
        return "not a constant Pad"
    if reader.op_type != "MaxPool" and not _pads_zero(pad):
        return "the pad value is not a constant zero"
    if reader.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        return "the reader pads automatically"
    rank = u.rank(x) or u.rank(pad.outputs[0]) or u.rank(reader.outputs[0])
    widths = _pad_widths(pad, rank)
    if widths is None:
        return "pads not constant or malformed"
    r = len(widths) // 2
    if r < 3 or (rank is not None and rank != r):
        # Conv and pooling inputs are [N, C, spatial...], one spatial axis or more
        return "not [N, C, spatial...] pads"
    if any(p < 0 for p in widths):
        return "negative pads crop"
    begins, ends = widths[:r], widths[r:]
    if begins[0] or begins[1] or ends[0] or ends[1]:
        return "pads the batch or channel axis (changes the result's shape)"
    spatial = r - 2
    if "pads" in reader.attributes:
        own = [int(p) for p in reader.attributes["pads"].as_ints()]
        if len(own) != 2 * spatial:
            return "the reader's pads are malformed"
    else:
        own = [0] * (2 * spatial)
    new = [own[i] + begins[2 + i] for i in range(spatial)] + [
        own[spatial + i] + ends[2 + i] for i in range(spatial)
    ]
    if reader.op_type in ("AveragePool", "MaxPool"):
        # onnxruntime rejects pooling pads that reach the kernel's extent
        kernel = reader.attributes.get_ints("kernel_shape", None)
        if kernel is None or len(kernel) != spatial:
            return "the kernel shape is unknown"
        if any(p >= kernel[i % spatial] for i, p in enumerate(new)):
            return "a pad would reach the kernel's extent"
    return reader, x, new


def _into(op: str) -> Callable[[ir.Node, RuleContext], Fold | str]:
    """Check: the Pad's only reader is an ``op`` taking it as its data input."""

    def check(node: ir.Node, ctx: RuleContext) -> Fold | str:
        out = node.outputs[0]
        if not u.single_consumer(out):
            return "the Pad's output has other readers"
        reader, index = next(iter(out.uses()))
        if index != 0 or not u.is_standard(reader) or reader.graph is not ctx.graph:
            return "not read as the data input of a standard op"
        if reader.op_type != op:
            return f"not read by {op}"
        if op == "AveragePool" and not _avgpool_counts_pads(reader):
            return "the pooling does not count pads (or uses ceil_mode)"
        if op == "MaxPool":
            refusal = _maxpool_ignores_pad(node, reader)
            if refusal is not None:
                return refusal
        return _fold(node, reader)

    return check


def _fold_pad(node: ir.Node, match: Fold, ctx: RuleContext) -> None:
    """Give the reader the summed pads, make it read the Pad's input and drop the Pad."""
    reader, x, new = match
    reader.attributes["pads"] = ir.AttrInt64s("pads", new)
    reader.replace_input_with(0, x)
    u.remove_nodes(ctx.graph, [node])


_ZERO_PAD = (
    "for a constant-mode Pad of constant zero value and constant non-negative pads that leave "
    "the batch and channel axes alone, read only there, and a reader with explicit pads"
)

RULES: tuple[Rule, ...] = (
    Rule(
        "pad-conv",
        "Conv(Pad(x, p), W, B) -> Conv(x, W, B) with p's spatial pads added to its pads, "
        + _ZERO_PAD,
        ("Pad",),
        _into("Conv"),
        _fold_pad,
    ),
    Rule(
        "pad-avgpool",
        "AveragePool(Pad(x, p)) -> AveragePool(x) with p's spatial pads added to its pads, when "
        f"count_include_pad=1, ceil_mode=0 and every pad stays below the kernel, {_ZERO_PAD}",
        ("Pad",),
        _into("AveragePool"),
        _fold_pad,
    ),
    Rule(
        "pad-maxpool",
        "MaxPool(Pad(x, p, v)) -> MaxPool(x) with p's spatial pads added to its pads, when v is "
        "at most x's lower bound (x from Relu or Sigmoid: 0, from Clip: its constant min), "
        "ceil_mode=0, every pad stays below the kernel and the Indices output is unread (each "
        "window keeps an element of x, which v never exceeds), for a constant-mode Pad of "
        "constant value and non-negative pads that leave the batch and channel axes alone, "
        "read only there, and a reader with explicit pads",
        ("Pad",),
        _into("MaxPool"),
        _fold_pad,
    ),
)


class PadFusion(RulePass):
    name = "fuse-pad"
    summary = "fold a constant Pad into the pads of the Conv, AveragePool or MaxPool reading it"
    rules = RULES
