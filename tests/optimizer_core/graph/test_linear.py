"""Fusions into Gemm and MatMul weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes

RNG = np.random.default_rng(1)
F = onnx.TensorProto.FLOAT
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _init(name, arr, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(arr, dtype=dtype), name)


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F, s) for n, s in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _linear(bias_shape=(5,), a_shape=("M", 4), follow=(), y_shape=None):
    """x -> MatMul(W) -> Add(b) -> [follow...] -> Relu -> y"""
    inits = [_init("W", RNG.standard_normal((4, 5))), _init("b", RNG.standard_normal(bias_shape))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
    ]
    cur = "a"
    for i, (op, shape) in enumerate(follow):
        if op == "BN":
            for p, arr in (
                ("g", RNG.uniform(0.5, 1.5, 5)),
                ("be", RNG.standard_normal(5)),
                ("mu", RNG.standard_normal(5)),
                ("var", RNG.uniform(0.5, 2, 5)),
            ):
                inits.append(_init(f"{p}{i}", arr))
            nodes.append(
                helper.make_node(
                    "BatchNormalization",
                    [cur, f"g{i}", f"be{i}", f"mu{i}", f"var{i}"],
                    [f"f{i}"],
                    epsilon=1e-3,
                )
            )
        else:
            inits.append(_init(f"k{i}", RNG.uniform(0.5, 2.0, shape)))
            nodes.append(helper.make_node(op, [cur, f"k{i}"], [f"f{i}"]))
        cur = f"f{i}"
    nodes.append(helper.make_node("Relu", [cur], ["y"]))
    y_shape = y_shape or [*a_shape[:-1], 5]
    return _model(nodes, [("x", list(a_shape))], [("y", list(y_shape))], inits)


def test_matmul_add_becomes_gemm_with_symbolic_batch():
    proto = _linear()
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["Gemm", "Relu"]
    assert rules_fired(result) == {"matmul-add-gemm": 1}
    assert out.graph.output[0].type.tensor_type.shape.dim[0].dim_param == "M"
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


@pytest.mark.parametrize("bias_shape", [(1, 5), (1,), ()], ids=["row", "one", "scalar"])
def test_matmul_add_broadcast_bias_shapes(bias_shape):
    proto = _linear(bias_shape=bias_shape)
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["Gemm", "Relu"]
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


def test_rank3_matmul_add_is_left_alone():
    proto = _linear(a_shape=("B", "S", 4))
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul", "Add", "Relu"]
    assert not rules_fired(result)


def test_bias_that_widens_the_result_is_left_alone():
    # x: [1, 4] @ W: [4, 5] = [1, 5]; + b: [3, 5] broadcasts the result to [3, 5]
    proto = _linear(bias_shape=(3, 5), a_shape=(1, 4), y_shape=(3, 5))
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert "Gemm" not in op_types(out)


def test_matmul_output_read_twice_is_left_alone():
    proto = _linear()
    extra = helper.make_tensor_value_info("m", F, ["M", 5])
    proto.graph.output.append(extra)
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul", "Add", "Relu"]


@pytest.mark.parametrize(
    ("follow", "rules"),
    [
        ([("BN", None)], {"gemm-bn"}),
        ([("Mul", (5,))], {"gemm-mul"}),
        ([("Div", (1, 5))], {"gemm-div"}),
        ([("Add", (5,))], {"gemm-add"}),
        ([("Mul", ()), ("Add", (1, 5)), ("BN", None)], {"gemm-mul", "gemm-add", "gemm-bn"}),
    ],
    ids=["bn", "mul", "div", "add", "chain"],
)
def test_affine_maps_fold_into_gemm(follow, rules):
    proto = _linear(follow=follow)
    out, result = run_passes(proto, ["fuse-gemm", "dead-code"])
    assert op_types(out) == ["Gemm", "Relu"]
    assert rules <= set(rules_fired(result))
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


def test_per_row_scale_is_not_folded():
    # a [M, 1] multiplier scales rows, not columns: it cannot go into B
    proto = _linear(follow=[("Mul", (3, 1))], a_shape=(3, 4))
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert "Mul" in op_types(out)
    assert_equivalent(proto, out, **TOL)


def test_tied_weight_is_not_rewritten():
    proto = _linear(follow=[("Mul", (5,))])
    proto.graph.node.append(helper.make_node("MatMul", ["x", "W"], ["z"]))
    proto.graph.output.append(helper.make_tensor_value_info("z", F, ["M", 5]))
    out, result = run_passes(proto, ["fuse-gemm"])
    assert "gemm-mul" not in rules_fired(result)
    assert op_types(out).count("Mul") == 1
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


def test_transposes_fold_into_gemm_and_matmul():
    inits = [_init("W", RNG.standard_normal((5, 4)))]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "wt"], ["y"]),
    ]
    proto = _model(nodes, [("x", [4, "M"])], [("y", ["M", 5])], inits)
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["Gemm"]
    attrs = {a.name: a.i for a in out.graph.node[0].attribute}
    assert attrs == {"transA": 1, "transB": 1}
    assert rules_fired(result)["matmul-transpose-gemm"] == 1
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})

    gemm_nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("Gemm", ["xt", "W"], ["y"], transB=1, alpha=0.5),
    ]
    proto = _model(gemm_nodes, [("x", [4, "M"])], [("y", ["M", 5])], inits)
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["Gemm"]
    assert rules_fired(result) == {"transpose-gemm": 1}
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


def test_transpose_with_other_readers_stays():
    inits = [_init("W", RNG.standard_normal((4, 5)))]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "W"], ["y"]),
        helper.make_node("Relu", ["xt"], ["z"]),
    ]
    proto = _model(nodes, [("x", [4, "M"])], [("y", ["M", 5]), ("z", ["M", 4])], inits)
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["Transpose", "MatMul", "Relu"]


@pytest.mark.parametrize("op", ["Mul", "Div"])
def test_matmul_scale_folds_into_weight_for_rank3(op):
    inits = [_init("W", RNG.standard_normal((4, 5))), _init("c", RNG.uniform(0.5, 2, (1, 1, 5)))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node(op, ["m", "c"], ["y"]),
    ]
    proto = _model(nodes, [("x", ["B", "S", 4])], [("y", ["B", "S", 5])], inits)
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul"]
    assert rules_fired(result) == {f"matmul-{op.lower()}": 1}
    assert_equivalent(proto, out, **TOL, dim_values={"B": 2, "S": 3})


def test_matmul_scale_with_non_constant_weight_is_left_alone():
    inits = [_init("c", [2.0])]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Mul", ["m", "c"], ["y"]),
    ]
    proto = _model(nodes, [("x", [3, 4]), ("w", [4, 5])], [("y", [3, 5])], inits)
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul", "Mul"]


def test_old_opset_is_left_alone():
    proto = _linear()
    proto.opset_import[0].version = 10
    out, _ = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul", "Add", "Relu"]


def test_compact_preset_checks_and_matches():
    proto = _linear(follow=[("BN", None), ("Mul", (5,))])
    out, _ = run_passes(proto, preset="compact")
    assert op_types(out) == ["Gemm", "Relu"]
    assert_equivalent(proto, out, **TOL, dim_values={"M": 3})


def test_computed_bias_is_left_to_cse():
    # Add(MatMul(x, W), r) with a computed r (a residual): kept, CSE may still merge the MatMul
    inits = [_init("W", RNG.standard_normal((4, 5)))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "r"], ["y"]),
    ]
    proto = _model(nodes, [("x", ["M", 4]), ("r", ["M", 5])], [("y", ["M", 5])], inits)
    out, result = run_passes(proto, ["fuse-gemm"])
    assert op_types(out) == ["MatMul", "Add"]
    assert not rules_fired(result)
