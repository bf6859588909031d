"""fuse-gemm declines with a reason where it cannot fuse, instead of failing the pass."""

from __future__ import annotations

import numpy as np
from onnx import helper

from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes
from tests.optimizer_core.graph.test_linear import _init, _model


def test_gemm_divided_by_a_constant_with_a_zero_is_left_alone():
    inits = [
        _init("W", np.ones((4, 5))),
        _init("b", np.ones(5)),
        _init("k", [1.0, 0.0, 2.0, 3.0, 4.0]),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Div", ["a", "k"], ["y"]),
    ]
    proto = _model(nodes, [("x", [3, 4])], [("y", [3, 5])], inits)
    out, result = run_passes(proto, ["fuse-gemm"])
    assert rules_fired(result) == {"matmul-add-gemm": 1}
    assert op_types(out) == ["Gemm", "Div"]
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)
