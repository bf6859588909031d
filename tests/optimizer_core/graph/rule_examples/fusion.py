"""Examples of the affine fusions' rules (pass ``fuse-affine``)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_fusion import (
    _branches_model,
    _conv_model,
    _conv_transpose_model,
    _fused_qkv_attention,
    _init,
    _scaled_input_conv,
    _separate_qk_attention,
)

# new weights are computed in float64 and rounded once to float32
_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _bn_then(op: str):
    def build() -> onnx.ModelProto:
        rng = np.random.default_rng(5)
        nodes = [
            helper.make_node("BatchNormalization", ["x", "g", "b", "m", "v"], ["n"]),
            helper.make_node(op, ["n", "c"], ["y"]),
        ]
        inits = [
            _init("g", rng.uniform(0.5, 1.5, 3)),
            _init("b", rng.standard_normal(3)),
            _init("m", rng.standard_normal(3)),
            _init("v", rng.uniform(0.5, 2, 3)),
            _init("c", rng.standard_normal((3, 1, 1))),
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4, 4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3, 4, 4])],
            inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    return build


EXAMPLES = {
    ("fuse-affine", "conv-bn"): Example(model=lambda: _conv_model(["BN"]), **_TOL),
    ("fuse-affine", "conv-mul"): Example(model=lambda: _conv_model(["Mul"]), **_TOL),
    ("fuse-affine", "conv-add"): Example(model=lambda: _conv_model(["Add"]), **_TOL),
    ("fuse-affine", "convtranspose-bn"): Example(
        model=lambda: _conv_transpose_model(["BN"], group=2), **_TOL
    ),
    ("fuse-affine", "convtranspose-mul"): Example(
        model=lambda: _conv_transpose_model(["Mul"]), **_TOL
    ),
    ("fuse-affine", "convtranspose-add"): Example(
        model=lambda: _conv_transpose_model(["Add"]), **_TOL
    ),
    ("fuse-affine", "mul-conv"): Example(
        model=lambda: _scaled_input_conv((1, 4, 1, 1), group=2), **_TOL
    ),
    ("fuse-affine", "conv-sum-conv"): Example(
        model=lambda: _branches_model([{"k": (3, 3)}, {"k": (1, 1)}], group=2), **_TOL
    ),
    ("fuse-affine", "conv-sum-identity"): Example(
        model=lambda: _branches_model([{"k": (3, 3)}, {"identity": True}], group=4), **_TOL
    ),
    ("fuse-affine", "conv-sum-bn"): Example(
        model=lambda: _branches_model([{"bn": True}, {"k": (1, 1)}]), **_TOL
    ),
    ("fuse-affine", "bn-mul"): Example(model=_bn_then("Mul"), **_TOL),
    ("fuse-affine", "bn-add"): Example(model=_bn_then("Add"), **_TOL),
    ("fuse-affine", "projection-mul"): Example(model=_fused_qkv_attention, **_TOL),
    ("fuse-affine", "projection-div"): Example(model=lambda: _separate_qk_attention("Div"), **_TOL),
}
