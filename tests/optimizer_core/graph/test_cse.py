"""Common-subexpression elimination: each rule fires, results are unchanged, the checker passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest

from tests.helpers import assert_equivalent, op_types, parse, run_passes

PASSES = ["cse", "dead-code"]


def fired(result) -> dict[str, int]:
    """The rules the cse pass fired (dead-code fires too)."""
    return result.log.per_pass().get("cse", {}).get("rules", {})


def test_duplicate_nodes_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Relu(x)
          b = Relu(x)
          y = Add(a, b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"duplicate-node": 1}
    assert op_types(out) == ["Relu", "Add"]
    assert list(out.graph.node[1].input) == ["a", "a"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_chain_of_duplicates_merged_in_one_pass():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a1 = Relu(x)
          b1 = Exp(a1)
          c1 = Mul(b1, x)
          a2 = Relu(x)
          b2 = Exp(a2)
          c2 = Mul(b2, x)
          y = Sub(c1, c2)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"duplicate-node": 3}
    # one run of the pass did it all: the next run finds nothing
    cse_runs = [r for r in result.log.records if r.pass_name == "cse"]
    assert [r.modified for r in cse_runs] == [True, False]
    assert op_types(out) == ["Relu", "Exp", "Mul", "Sub"]
    assert list(out.graph.node[3].input) == ["c1", "c1"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_commuted_inputs_are_not_duplicates():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, float[N, 4] z) => (float[N, 4] y) {
          a = Sub(x, z)
          b = Sub(z, x)
          y = Add(a, b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Sub", "Sub", "Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_duplicate_initializers_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y)
          <float[4] w1 = {1, 2, 3, 4}, float[4] w2 = {1, 2, 3, 4}, float[4] w3 = {1, 2, 3, 5}>
        {
          a = Mul(x, w1)
          b = Mul(x, w2)
          c = Mul(x, w3)
          d = Add(a, b)
          y = Add(d, c)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    # the copies of the weight merge, then the Muls reading them become duplicates
    assert fired(result) == {"duplicate-initializer": 1, "duplicate-node": 1}
    assert sorted(i.name for i in out.graph.initializer) == ["w1", "w3"]
    assert op_types(out) == ["Mul", "Mul", "Add", "Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize("differ_at", [None, 1], ids=["equal", "off-sample"])
def test_large_initializers_told_apart_beyond_the_sampled_elements(differ_at):
    # 1000 elements: the sample reads 64 of them; element 1 is not among them
    base = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    other = base.copy()
    if differ_at is not None:
        other[differ_at] += 1.0
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Mul", ["x", "w1"], ["a"]),
            onnx.helper.make_node("Mul", ["x", "w2"], ["b"]),
            onnx.helper.make_node("Add", ["a", "b"], ["y"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1000])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1000])],
        [
            onnx.numpy_helper.from_array(base, "w1"),
            onnx.numpy_helper.from_array(other, "w2"),
        ],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    proto.ir_version = 8
    out, result = run_passes(proto, PASSES)
    names = sorted(i.name for i in out.graph.initializer)
    if differ_at is None:
        assert fired(result) == {"duplicate-initializer": 1, "duplicate-node": 1}
        assert names == ["w1"]
    else:
        assert not fired(result)
        assert names == ["w1", "w2"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("w1", "w2"),
    [
        ("float[4] w1 = {1, 2, 3, 4}", "double[4] w2 = {1, 2, 3, 4}"),
        ("float[4] w1 = {1, 2, 3, 4}", "float[2, 2] w2 = {1, 2, 3, 4}"),
        ("int32[2] w1 = {0, 1}", "int64[1] w2 = {4294967296}"),
    ],
    ids=["dtype", "shape", "same-bytes"],
)
def test_initializers_with_same_data_but_other_type_kept(w1, w2):
    t1, t2 = w1.split(" w")[0], w2.split(" w")[0]
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => ({t1} y1, {t2} y2) <{w1}, {w2}> {{
          y1 = Neg(w1)
          y2 = Neg(w2)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert sorted(i.name for i in out.graph.initializer) == ["w1", "w2"]
    assert [list(n.input) for n in out.graph.node] == [["w1"], ["w2"]]
    assert_equivalent(proto, out)


def test_initializer_that_is_a_graph_input_not_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] w2) => (float[4] y) <float[4] w1 = {1, 2, 3, 4}, float[4] w2 = {1, 2, 3, 4}> {
          a = Mul(x, w1)
          b = Mul(x, w2)
          y = Add(a, b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Mul", "Mul", "Add"]
    assert sorted(i.name for i in out.graph.initializer) == ["w1", "w2"]
    assert_equivalent(proto, out)


def test_duplicate_constant_nodes_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          c1 = Constant<value = float[4] {1, 2, 3, 4}>()
          c2 = Constant<value = float[4] {1, 2, 3, 4}>()
          c3 = Constant<value = float[4] {1, 2, 3, 5}>()
          k1 = Constant<value_float = 2.0>()
          k2 = Constant<value_float = 2.0>()
          a = Mul(x, c1)
          b = Add(a, c2)
          c = Sub(b, c3)
          d = Mul(c, k1)
          y = Div(d, k2)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"duplicate-constant": 2}
    assert op_types(out) == ["Constant"] * 3 + ["Mul", "Add", "Sub", "Mul", "Div"]
    assert list(out.graph.node[4].input) == ["a", "c1"]
    assert list(out.graph.node[7].input) == ["d", "k1"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    "op",
    [
        "RandomNormal<shape = [2, 4]>()",
        "RandomUniform<shape = [2, 4]>()",
        "RandomNormalLike(x)",
        "RandomUniformLike(x)",
        "Bernoulli(p)",
    ],
    ids=["normal", "uniform", "normal-like", "uniform-like", "bernoulli"],
)
def test_random_ops_never_merged(op):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 4] x, float[2, 4] p) => (float[2, 4] y) {{
          a = {op}
          b = {op}
          y = Sub(a, b)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert len(out.graph.node) == 3
    # the outputs are random: only the structure and the checker can be compared
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("Softmax<axis = 0>(x)", "Softmax<axis = 1>(x)"),
        ("LeakyRelu<alpha = 0.1>(x)", "LeakyRelu<alpha = 0.2>(x)"),
        ("Transpose<perm = [0, 1]>(x)", "Transpose(x)"),
        ("Cast<to = 1>(x)", "Cast<to = 11>(x)"),
        ("Relu(x)", "Sigmoid(x)"),
        ("Relu(x)", "Relu(z)"),
    ],
    ids=["axis", "alpha", "perm-given-vs-default", "cast-to", "op", "inputs"],
)
def test_nodes_that_differ_are_kept(first, second):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 4] x, float[4, 4] z) => (float[4, 4] y1, float[4, 4] y2) {{
          a = {first}
          b = {second}
          y1 = Identity(a)
          y2 = Identity(b)
        }}
        """.replace(
            "float[4, 4] y1", "double[4, 4] y1" if "to = 11" in first else "float[4, 4] y1"
        ).replace("float[4, 4] y2", "double[4, 4] y2" if "to = 11" in second else "float[4, 4] y2")
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert len(out.graph.node) == 4
    assert_equivalent(proto, out)


def test_duplicate_producing_a_graph_output_keeps_the_output_name():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          a = Relu(x)
          z = Neg(a)
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"duplicate-node": 1}
    assert op_types(out) == ["Relu", "Neg"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    # the surviving Relu now produces y and feeds z
    assert list(out.graph.node[0].output) == ["y"]
    assert list(out.graph.node[1].input) == ["y"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_duplicates_that_are_both_graph_outputs_are_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          y = Relu(x)
          z = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Relu", "Relu"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_duplicate_multi_output_nodes_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 6] x) => (float[N, 3] y) {
          a1, b1 = Split<axis = 1, num_outputs = 2>(x)
          a2, b2 = Split<axis = 1, num_outputs = 2>(x)
          s1 = Add(a1, b2)
          y = Mul(s1, b1)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"duplicate-node": 1}
    assert op_types(out) == ["Split", "Add", "Mul"]
    assert list(out.graph.node[1].input) == ["a1", "b1"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_custom_domain_nodes_never_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = com.example.MyOp(x)
          b = com.example.MyOp(x)
          y = Add(a, b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert [n.op_type for n in out.graph.node] == ["MyOp", "MyOp", "Add"]
    onnx.checker.check_model(out, full_check=False)


@pytest.mark.parametrize(("dims", "merged"), [("B, S, 4", True), ("B, T, 4", False)])
def test_one_named_dim_is_read_once(dims, merged):
    from tests.optimizer_core.graph.rule_examples.cse import SAME_DIM

    proto = parse(
        SAME_DIM.replace("float[B, S, 4] h", f"float[{dims}] h").replace(
            "float[B, S, 4] y", f"float[{dims}] y"
        )
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result).get("same-dim-read", 0) == (1 if merged else 0)
    assert op_types(out).count("Shape") == (1 if merged else 2)
    assert_equivalent(proto, out, dim_values={"B": 2, "S": 3, "T": 3})
