"""Examples of the ``identity`` rules: ``x = Neg(xin)`` goes through the no-op to ``y``."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.rule_examples._build import model


def _noop(expr: str, inits: str = "", sig: str = "(float[2, 4] xin) => (float[2, 4] y)") -> Example:
    return Example(model=model(f"x = Neg(xin)\n {expr}", inits=inits, sig=sig))


AXES = "int64[1] ax = {0}"

EXAMPLES: dict[tuple[str, str], Example] = {
    ("identity", "identity"): _noop("y = Identity(x)"),
    ("identity", "dropout-inference"): _noop("y = Dropout(x)"),
    ("identity", "cast-same-type"): _noop("y = Cast<to = 1>(x)"),
    ("identity", "reshape-noop"): _noop("y = Reshape(x, s)", "int64[2] s = {2, 4}"),
    ("identity", "transpose-noop"): _noop("y = Transpose<perm = [0, 1]>(x)"),
    ("identity", "unsqueeze-squeeze"): _noop("a = Unsqueeze(x, ax)\n y = Squeeze(a, ax)", AXES),
    ("identity", "squeeze-noop"): _noop("y = Squeeze(x)"),
    ("identity", "squeeze-unsqueeze"): _noop(
        "a = Squeeze(x, ax)\n y = Unsqueeze(a, ax)", AXES, "(float[1, 4] xin) => (float[1, 4] y)"
    ),
    ("identity", "expand-noop"): _noop("y = Expand(x, s)", "int64[1] s = {4}"),
    ("identity", "slice-noop"): _noop(
        "y = Slice(x, st, en)", "int64[1] st = {0}, int64[1] en = {4}"
    ),
    ("identity", "pad-noop"): _noop("y = Pad(x, p)", "int64[4] p = {0, 0, 0, 0}"),
    ("identity", "concat-single"): _noop("y = Concat<axis = 0>(x)"),
    ("identity", "flatten-noop"): _noop("y = Flatten<axis = 1>(x)"),
    ("identity", "reduce-unit-axes"): Example(
        model=model(
            "x = Neg(xin)\n y = ReduceProd<axes = [1]>(x)",
            sig="(float[3, 1] xin) => (float[3, 1] y)",
            opset=17,
        )
    ),
}


def _loop_with_constant_condition() -> onnx.ModelProto:
    """A scripted loop's body: its condition output is Identity of an outer constant true."""
    body = oh.make_graph(
        [
            oh.make_node("Add", ["acc", "step"], ["acc_out"]),
            oh.make_node("Identity", ["keep_going"], ["cond_out"]),
        ],
        "body",
        [
            oh.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            oh.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []),
            oh.make_tensor_value_info("acc", onnx.TensorProto.FLOAT, [2, 4]),
        ],
        [
            oh.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            oh.make_tensor_value_info("acc_out", onnx.TensorProto.FLOAT, [2, 4]),
        ],
    )
    graph = oh.make_graph(
        [oh.make_node("Loop", ["n", "keep_going", "xin"], ["y"], body=body)],
        "loop",
        [
            oh.make_tensor_value_info("xin", onnx.TensorProto.FLOAT, [2, 4]),
            oh.make_tensor_value_info("n", onnx.TensorProto.INT64, []),
        ],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [
            onh.from_array(np.array(True), "keep_going"),
            onh.from_array(np.full((2, 4), 0.5, np.float32), "step"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


EXAMPLES[("identity", "identity-of-constant-body-output")] = Example(
    model=_loop_with_constant_condition
)
