"""Recurrent ops' optional inputs that equal their defaults are omitted.

``RNN``, ``GRU`` and ``LSTM`` start from a zero hidden (and cell) state and add no bias or
peephole when those inputs are absent. Exporters often feed them anyway: torch's TorchScript
exporter builds the zero initial state from the batch size at run time
(``ConstantOfShape(Concat(1, Gather(Shape(x), 1), hidden))``, then a ``Slice`` per layer), which
no constant folding can remove while the batch is dynamic. Dropping the input is exact: the op
computes the same with its default, and the nodes that built the zeros go dead.

A value is known to be all zeros when it is a constant of +0 elements, a ``ConstantOfShape`` of
0 (or without a value), or what a pure data-movement op (``Slice``, ``Reshape``, ``Expand``,
``Squeeze``, ``Unsqueeze``, ``Transpose``, ``Flatten``, ``Identity``, ``Tile``, ``Gather`` of its
data) or a ``Concat`` makes of such values. Negative zeros are not accepted (exactness: ``-0 * w``
keeps a sign the default would not).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass

_MOVES = ("Slice", "Reshape", "Expand", "Squeeze", "Unsqueeze", "Transpose", "Flatten",
          "Identity", "Tile", "Gather")  # fmt: skip
_MAX_DEPTH = 8


def _positive_zeros(arr: np.ndarray) -> bool:
    if arr.dtype == object or arr.size > 1 << 20:
        return False
    zero = arr == 0
    if arr.dtype.kind in "fc":
        zero &= ~np.signbit(arr.real if arr.dtype.kind == "c" else arr)
    return bool(np.all(zero))


def all_zeros(value: ir.Value | None, depth: int = 0) -> bool:
    """Whether ``value`` is provably all +0 (see the module docstring)."""
    if value is None or depth > _MAX_DEPTH:
        return False
    arr = u.const_array(value)
    if arr is not None:
        return _positive_zeros(arr)
    node = value.producer()
    if node is None or not u.is_standard(node) or u.has_subgraph(node):
        return False
    if node.op_type == "ConstantOfShape":
        attr = node.attributes.get("value")
        if attr is None:
            return True  # the default fill is a float32 0
        try:
            return _positive_zeros(attr.as_tensor().numpy())
        except Exception:
            return False
    if node.op_type in _MOVES:
        return all_zeros(node.inputs[0], depth + 1)
    if node.op_type == "Concat":
        return all(all_zeros(v, depth + 1) for v in node.inputs)
    return False


# op -> positions of its state inputs (initial_h, and initial_c for LSTM)
_STATE = {"RNN": (5,), "GRU": (5,), "LSTM": (5, 6)}
# op -> positions of its bias-like inputs (B, and the peepholes P for LSTM)
_BIAS = {"RNN": (3,), "GRU": (3,), "LSTM": (3, 7)}


def _zero_inputs(node: ir.Node, positions: tuple[int, ...]) -> list[int] | str:
    found = [
        i
        for i in positions
        if i < len(node.inputs) and node.inputs[i] is not None and all_zeros(node.inputs[i])
    ]
    return found or "no such input is provably all zeros"


def _zero_state(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    return _zero_inputs(node, _STATE[node.op_type])


def _zero_bias(node: ir.Node, ctx: RuleContext) -> list[int] | str:
    return _zero_inputs(node, _BIAS[node.op_type])


def _omit(node: ir.Node, positions: list[int], ctx: RuleContext) -> None:
    for i in positions:
        node.replace_input_with(i, None)


RULES: tuple[Rule, ...] = (
    Rule(
        "zero-initial-state",
        "RNN/GRU/LSTM(x, W, R, B, lens, h0, c0) -> the same without h0 (and c0) when they are "
        "all +0: the default initial state is zeros",
        ("RNN", "GRU", "LSTM"),
        _zero_state,
        _omit,
    ),
    Rule(
        "zero-bias",
        "RNN/GRU/LSTM(x, W, R, B, ..., P) -> the same without B (and LSTM's peepholes P) when "
        "they are all +0: the default bias and peepholes are zeros",
        ("RNN", "GRU", "LSTM"),
        _zero_bias,
        _omit,
    ),
)


class RecurrentDefaults(RulePass):
    name = "rnn-defaults"
    summary = "omit RNN/GRU/LSTM initial states, biases and peepholes that are all zeros"
    rules = RULES
