"""Scalar inputs: ops whose definition takes a scalar get a rank-0 value.

``Range``'s start, limit and delta, the window ops' size, ``DFT``'s dft_length and axis and the
like are scalars by definition, yet onnxruntime's kernels also accept a one-element tensor of
rank 1, and a model may feed one (onnx's own function body of ``AffineGrid`` feeds ``Range``
from ``Split`` outputs of shape [1]). Such a model loads only while static inference cannot see
the rank: once a rewrite makes the value a constant, or moves it out of an ``If`` branch
(constant folding of the condition, ``If`` inlining, the runtime's own folding at load), the
runtime's shape inference rejects the model ("Input to 'Range' op should be scalars").

This pass is the repair: an input of known rank >= 1 whose dims are all 1 or unknown is replaced
by a scalar of the same value (a constant is rewritten as a rank-0 constant, anything else goes
through ``Squeeze`` without axes, which drops every dimension of size 1). It changes no numbers:
a tensor with more than one element fails in the kernel already. The fixed-point driver runs it
after every pass that changed the model, so each intermediate model loads too.
"""

from __future__ import annotations

import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.rules import Rule, RuleContext, RulePass

# op -> positions of the inputs its definition declares as scalars (0-D tensors)
SCALAR_INPUTS: dict[str, tuple[int, ...]] = {
    "Range": (0, 1, 2),
    "BlackmanWindow": (0,),
    "HammingWindow": (0,),
    "HannWindow": (0,),
    "DFT": (1, 2),  # dft_length; axis (an input from opset 20)
    "STFT": (1, 3),  # frame_step, frame_length
    "MelWeightMatrix": (0, 1, 2, 3, 4),
    "CumSum": (1,),  # axis
    "Trilu": (1,),  # k
    "SequenceAt": (1,),  # position
    "SequenceErase": (1,),
    "SequenceInsert": (2,),
}


def _one_element_rank_n(value: ir.Value) -> bool:
    """Known rank >= 1 and no dim known to differ from 1."""
    d = u.dims(value)
    return bool(d) and all(x is None or x == 1 for x in d)  # type: ignore[union-attr]


def _tensor_inputs(node: ir.Node, ctx: RuleContext) -> list[tuple[int, ir.Value]] | str:
    """The inputs the op takes as scalars that are one-element tensors of rank >= 1."""
    found = []
    for i in SCALAR_INPUTS[node.op_type]:
        value = node.inputs[i] if i < len(node.inputs) else None
        if value is not None and _one_element_rank_n(value):
            found.append((i, value))
    return found or "every scalar input is a scalar or of unknown rank"


def _make_scalar(node: ir.Node, found: list[tuple[int, ir.Value]], ctx: RuleContext) -> None:
    """Feed each found input as a scalar; one count per input (the driver counts the first)."""
    assert isinstance(ctx.pass_, ScalarInputs)
    for i, value in found:
        node.replace_input_with(i, _scalar(ctx.graph, node, value, ctx.pass_.names(ctx.model)))
    if len(found) > 1:
        ctx.pass_.hit("scalar-input", len(found) - 1)


def _scalar(graph: ir.Graph, node: ir.Node, value: ir.Value, namer: u.NameGenerator) -> ir.Value:
    array = u.const_array(value)
    if array is not None and array.size == 1:
        return u.add_initializer(graph, array.reshape(()), namer(f"{value.name}_scalar"))
    squeeze = ir.node("Squeeze", [value])
    out = squeeze.outputs[0]
    out.name = namer(f"{value.name}_scalar")
    out.shape = ir.Shape([])
    if value.type is not None:
        out.type = value.type
    graph.insert_before(node, squeeze)
    return out


RULES: tuple[Rule, ...] = (
    Rule(
        "scalar-input",
        "op(.., t, ..) -> op(.., scalar(t), ..) for an input the op defines as a scalar and a "
        "tensor t of rank >= 1 and one element: a constant reshaped to rank 0, else Squeeze(t); "
        "counted once per input",
        tuple(SCALAR_INPUTS),
        _tensor_inputs,
        _make_scalar,
    ),
)


class ScalarInputs(RulePass):
    name = "scalar-inputs"
    summary = "feed ops that take scalars (Range, DFT, window sizes) rank-0 values"
    rules = RULES
