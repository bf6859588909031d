"""Sibling MatMuls on one input merged into one MatMul and a Split."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes

RNG = np.random.default_rng(3)
F = onnx.TensorProto.FLOAT
TOL = {"rtol": 1e-5, "atol": 1e-5}
DIMS = {"B": 2, "S": 3}


def _qkv(*, bias: bool = True, widths=(8, 8, 4), shared: bool = False, opset: int = 17):
    inits, nodes, outputs = [], [], []
    for i, n in enumerate(widths):
        inits.append(
            numpy_helper.from_array(RNG.standard_normal((6, n)).astype(np.float32), f"W{i}")
        )
        nodes.append(helper.make_node("MatMul", ["x", f"W{i}"], [f"m{i}"]))
        out = f"m{i}"
        if bias:
            inits.append(
                numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), f"b{i}")
            )
            nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]))
            out = f"a{i}"
        nodes.append(helper.make_node("Relu", [out], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", F, ["B", "S", n]))
    if shared:
        nodes.append(helper.make_node("MatMul", ["z", "W0"], ["w_other"]))
        outputs.append(helper.make_tensor_value_info("w_other", F, ["B", widths[0]]))
    inputs = [helper.make_tensor_value_info("x", F, ["B", "S", 6])]
    if shared:
        inputs.append(helper.make_tensor_value_info("z", F, ["B", 6]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("bias", [True, False], ids=["with-bias", "no-bias"])
def test_qkv_projections_merge(bias):
    proto = _qkv(bias=bias)
    out, result = run_passes(proto, ["fuse-siblings", "dead-code"])
    ops = op_types(out)
    assert ops.count("MatMul") == 1 and ops.count("Split") == 1
    assert ops.count("Add") == (1 if bias else 0)
    assert rules_fired(result) == {"matmul-siblings-bias" if bias else "matmul-siblings": 1}
    assert [o.name for o in out.graph.output] == ["y0", "y1", "y2"]
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_mixed_biases_merge_the_matmuls_only():
    proto = _qkv()
    # the last projection has no bias: one Add cannot serve them all
    for node in proto.graph.node:
        if node.op_type == "Relu" and node.input[0] == "a2":
            node.input[0] = "m2"
    proto.graph.node.remove(next(n for n in proto.graph.node if n.output[0] == "a2"))
    out, result = run_passes(proto, ["fuse-siblings", "dead-code"])
    assert rules_fired(result) == {"matmul-siblings": 1}
    assert op_types(out).count("Add") == 2
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_shared_weight_is_not_merged():
    proto = _qkv(shared=True)
    out, result = run_passes(proto, ["fuse-siblings", "dead-code"])
    # W0 is also read by another MatMul: only W1 and W2 merge
    assert rules_fired(result) == {"matmul-siblings-bias": 1}
    assert op_types(out).count("MatMul") == 3
    assert_equivalent(proto, out, **TOL, dim_values=DIMS)


def test_single_matmul_and_old_opset_are_left_alone():
    _, result = run_passes(_qkv(widths=(8,)), ["fuse-siblings"])
    assert not rules_fired(result)
    _, result = run_passes(_qkv(opset=12), ["fuse-siblings"])
    assert not rules_fired(result)


def test_size_cap():
    from graphtrim.graph.framework import OptimizeOptions

    proto = _qkv()
    _, result = run_passes(
        proto, ["fuse-siblings"], options=OptimizeOptions(fold_max_tensor_bytes=100)
    )
    assert not rules_fired(result)


def test_siblings_are_in_compact_not_default():
    from graphtrim.graph.presets import PRESETS

    assert "fuse-siblings" in PRESETS["compact"]
    assert "fuse-siblings" not in PRESETS["default"]
    out, _ = run_passes(_qkv(), preset="compact")
    assert op_types(out).count("MatMul") == 1
    out, _ = run_passes(_qkv())
    assert op_types(out).count("MatMul") == 3
