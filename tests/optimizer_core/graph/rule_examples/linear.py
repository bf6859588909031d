"""Examples of the Gemm fusions' rules (pass ``fuse-gemm``)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_linear import _init, _linear, _model

# new weights are computed in float64 and rounded once; Gemm sums the bias in another order
_TOL = {"rtol": 1e-5, "atol": 1e-5}
_RNG = np.random.default_rng(3)


def _after_gemm(op: str, shape: tuple[int, ...] | None = None):
    def build() -> onnx.ModelProto:
        return _linear(a_shape=(3, 4), follow=[(op, shape)])

    return build


def _transposed_matmul() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "W"], ["y"]),
    ]
    return _model(
        nodes, [("x", [4, 3])], [("y", [3, 5])], [_init("W", _RNG.standard_normal((4, 5)))]
    )


def _transposed_gemm() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("Gemm", ["xt", "W"], ["y"], transB=1, alpha=0.5),
    ]
    return _model(
        nodes, [("x", [4, 3])], [("y", [3, 5])], [_init("W", _RNG.standard_normal((5, 4)))]
    )


def _scaled_matmul(op: str):
    def build() -> onnx.ModelProto:
        inits = [
            _init("W", _RNG.standard_normal((4, 5))),
            _init("c", _RNG.uniform(0.5, 2, (1, 1, 5))),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["m"]),
            helper.make_node(op, ["m", "c"], ["y"]),
        ]
        return _model(nodes, [("x", [2, 3, 4])], [("y", [2, 3, 5])], inits)

    return build


EXAMPLES = {
    ("fuse-gemm", "transpose-gemm"): Example(model=_transposed_gemm, **_TOL),
    ("fuse-gemm", "matmul-transpose-gemm"): Example(model=_transposed_matmul, **_TOL),
    ("fuse-gemm", "matmul-add-gemm"): Example(model=lambda: _linear(a_shape=(3, 4)), **_TOL),
    ("fuse-gemm", "gemm-add"): Example(model=_after_gemm("Add", (5,)), **_TOL),
    ("fuse-gemm", "gemm-mul"): Example(model=_after_gemm("Mul", (5,)), **_TOL),
    ("fuse-gemm", "gemm-div"): Example(model=_after_gemm("Div", (1, 5)), **_TOL),
    ("fuse-gemm", "gemm-bn"): Example(model=_after_gemm("BN"), **_TOL),
    ("fuse-gemm", "matmul-mul"): Example(model=_scaled_matmul("Mul"), **_TOL),
    ("fuse-gemm", "matmul-div"): Example(model=_scaled_matmul("Div"), **_TOL),
}
