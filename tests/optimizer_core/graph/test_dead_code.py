"""Dead-code elimination and constant lifting: each rule fires, results are unchanged, the
checker passes."""

from __future__ import annotations

import onnx
import onnx.helper
import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

# ---------------------------------------------------------------- dead-code


def test_dead_chain_removed_in_one_pass():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Neg(x)
          b = Exp(a)
          c = Abs(b)
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert op_types(out) == ["Relu"]
    assert rules_fired(result) == {"dead-node": 3}
    # the whole chain goes in the first run; the second run finds nothing
    first = [r for r in result.log.records if r.modified]
    assert len(first) == 1 and first[0].nodes_removed == 3
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_graph_outputs_and_what_they_read_are_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] z) {
          a = Neg(x)
          y = Exp(a)
          z = Abs(a)
          dead = Sigmoid(y)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert op_types(out) == ["Neg", "Exp", "Abs"]
    assert rules_fired(result) == {"dead-node": 1}
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_equivalent(proto, out)


def test_node_with_one_used_output_is_kept_whole():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[6] x) => (float[2] y) {
          a, b, c = Split<num_outputs = 3>(x)
          y = Neg(b)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert op_types(out) == ["Split", "Neg"]
    assert not rules_fired(result)
    assert not result.modified
    assert_equivalent(proto, out)


def test_unused_initializers_removed_but_initializer_inputs_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] w) => (float[4] y)
          <float[4] w = {1, 2, 3, 4}, float[4] unused = {1, 1, 1, 1}, float[4] used = {2, 2, 2, 2}>
        {
          y = Add(x, used)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert rules_fired(result) == {"unused-initializer": 1}
    # w is an initializer listed as a graph input: part of the interface, so it stays
    assert sorted(i.name for i in out.graph.initializer) == ["used", "w"]
    assert [i.name for i in out.graph.input] == ["x", "w"]
    assert_equivalent(proto, out)


def test_initializer_read_only_by_dead_nodes_goes_too():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <float[4] c = {1, 2, 3, 4}> {
          a = Mul(x, c)
          b = Neg(a)
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert op_types(out) == ["Relu"]
    assert len(out.graph.initializer) == 0
    fired = rules_fired(result)
    assert fired["dead-node"] == 2 and fired["unused-initializer"] == 1
    assert_equivalent(proto, out)


def test_unused_custom_opset_import_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[4] x) => (float[4] y) {
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert rules_fired(result) == {"unused-opset": 1}
    assert {o.domain for o in out.opset_import} == {""}
    assert op_types(out) == ["Relu"]
    assert_equivalent(proto, out)


def test_used_custom_opset_import_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[4] x) => (float[4] y) {
          t = com.example.MyOp(x)
          y = Relu(t)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert not rules_fired(result)
    assert {o.domain for o in out.opset_import} == {"", "com.example"}
    onnx.checker.check_model(out, full_check=False)


def test_node_without_outputs_is_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17, "com.example" : 1]>
        g (float[4] x) => (float[4] y) {
          dead = Neg(x)
          y = Relu(x)
        }
        """
    )
    # a node run only for its effect (the text format cannot write a node without outputs)
    proto.graph.node.insert(1, onnx.helper.make_node("Log", ["x"], [], domain="com.example"))
    onnx.checker.check_model(proto, full_check=True)
    out, result = run_passes(proto, ["dead-code"])
    assert rules_fired(result) == {"dead-node": 1}
    assert [(n.domain, n.op_type) for n in out.graph.node] == [("com.example", "Log"), ("", "Relu")]
    assert {o.domain for o in out.opset_import} == {"", "com.example"}
    onnx.checker.check_model(out, full_check=True)


def test_nothing_dead_is_not_a_change():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <float[4] c = {1, 2, 3, 4}> {
          a = Mul(x, c)
          y = Relu(a)
        }
        """
    )
    out, result = run_passes(proto, ["dead-code"])
    assert not result.modified
    assert not rules_fired(result)
    assert op_types(out) == ["Mul", "Relu"]
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- lift-constants


@pytest.mark.parametrize(
    "constant",
    [
        "c = Constant<value = float[4] {1, 2, 3, 4}>()",
        "c = Constant<value_float = 2.5>()",
        "c = Constant<value_floats = [1.0, 2.0, 3.0, 4.0]>()",
    ],
    ids=["value", "value_float", "value_floats"],
)
def test_constant_becomes_initializer(constant):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {{
          {constant}
          y = Mul(x, c)
        }}
        """
    )
    out, result = run_passes(proto, ["lift-constants"])
    assert rules_fired(result) == {"constant-to-initializer": 1}
    assert op_types(out) == ["Mul"]
    assert [i.name for i in out.graph.initializer] == ["c"]
    assert list(out.graph.node[0].input) == ["x", "c"]
    assert_equivalent(proto, out)


def test_int_constant_becomes_initializer():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 6] x) => (float[3, 4] y) {
          s = Constant<value_ints = [3, 4]>()
          y = Reshape(x, s)
        }
        """
    )
    out, result = run_passes(proto, ["lift-constants"])
    assert rules_fired(result) == {"constant-to-initializer": 1}
    assert op_types(out) == ["Reshape"]
    (init,) = out.graph.initializer
    assert init.data_type == onnx.TensorProto.INT64
    assert_equivalent(proto, out)


def test_constant_that_is_a_graph_output_stays_a_node():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] c) {
          c = Constant<value = float[4] {1, 2, 3, 4}>()
          k = Constant<value = float[4] {5, 6, 7, 8}>()
          y = Mul(x, k)
        }
        """
    )
    out, result = run_passes(proto, ["lift-constants"])
    assert rules_fired(result) == {"constant-to-initializer": 1}
    assert op_types(out) == ["Constant", "Mul"]
    assert [i.name for i in out.graph.initializer] == ["k"]
    assert [o.name for o in out.graph.output] == ["y", "c"]
    assert_equivalent(proto, out)


def test_string_constant_stays_a_node():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
          s = Constant<value_string = "hello">()
          y = Relu(x)
        }
        """
    )
    out, result = run_passes(proto, ["lift-constants"])
    assert not rules_fired(result)
    assert op_types(out) == ["Constant", "Relu"]
    assert_equivalent(proto, out)
