"""Identity elimination: each rule fires, results are unchanged, the checker passes."""

from __future__ import annotations

import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes


def test_identity_chain_removed_and_output_name_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Identity(x)
          b = Relu(a)
          c = Identity(b)
          y = Identity(c)
        }
        """
    )
    out, result = run_passes(proto, ["identity", "dead-code"])
    assert op_types(out) == ["Relu"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert rules_fired(result)["identity"] == 3
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        ("y = Cast<to = 1>(x)", "cast-same-type"),
        ("y = Transpose<perm = [0, 1]>(x)", "transpose-noop"),
        ("s = Constant<value = int64[2] {0, 4}>()\n y = Reshape(x, s)", "reshape-noop"),
        ("s = Constant<value = int64[2] {-1, 4}>()\n y = Reshape(x, s)", "reshape-noop"),
        ("s = Constant<value = int64[1] {4}>()\n y = Expand(x, s)", "expand-noop"),
        ("p = Constant<value = int64[4] {0, 0, 0, 0}>()\n y = Pad(x, p)", "pad-noop"),
        ("y = Concat<axis = 0>(x)", "concat-single"),
        ("y = Flatten<axis = 1>(x)", "flatten-noop"),
        ("y = Dropout(x)", "dropout-inference"),
        (
            "s = Constant<value = int64[1] {0}>()\n e = Constant<value = int64[1] {9223372036854775807}>()\n"
            " a = Constant<value = int64[1] {1}>()\n y = Slice(x, s, e, a)",
            "slice-noop",
        ),
        (
            "a = Constant<value = int64[1] {1}>()\n u = Unsqueeze(x, a)\n y = Squeeze(u, a)",
            "unsqueeze-squeeze",
        ),
    ],
)
def test_noop_rules(body, rule):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {{
          x = Relu(xin)
          {body}
        }}
        """
    )
    out, result = run_passes(proto, ["lift-constants", "identity", "dead-code"])
    assert rules_fired(result).get(rule, 0) >= 1, rules_fired(result)
    assert op_types(out) == ["Relu"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    "body",
    [
        "y = Cast<to = 11>(x)",  # a real conversion
        "s = Constant<value = int64[2] {4, -1}>()\n y = Reshape(x, s)",  # N unknown: may reorder dims
        "s = Constant<value = int64[3] {3, 1, 4}>()\n y = Expand(x, s)",  # adds a dim
        "p = Constant<value = int64[4] {0, 1, 0, 0}>()\n y = Pad(x, p)",
        "y = Transpose<perm = [1, 0]>(x)",
        "y = Dropout(x, r, t)",
    ],
)
def test_not_a_noop_is_kept(body):
    inputs = "float[N, 4] x"
    if "Dropout(x, r, t)" in body:
        inputs += ", float r, bool t"
    out_type = "double[N, 4]" if "to = 11" in body else "float[M, K]"
    if "{3, 1, 4}" in body:
        out_type = "float[A, B, C]"
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({inputs}) => ({out_type} y) {{
          {body}
        }}
        """
    )
    out, _ = run_passes(proto, ["lift-constants", "identity", "dead-code"])
    assert len(out.graph.node) == 1
    if "Dropout" not in body:
        assert_equivalent(proto, out, dim_values={"N": 3})


def test_dropout_with_used_mask_is_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, bool[N, 4] m) {
          y, m = Dropout(x)
        }
        """
    )
    out, _ = run_passes(proto, ["identity", "dead-code"])
    assert op_types(out) == ["Dropout"]


@pytest.mark.parametrize(
    ("body", "opset"),
    [
        ("y = ReduceProd<axes = [1]>(x)", 17),  # skl2onnx's PolynomialFeatures column products
        ("y = ReduceSum<axes = [-1]>(x)", 11),
        ("a = Constant<value = int64[1] {1}>()\n y = ReduceMax(x, a)", 18),
        ("y = ReduceMean<axes = [1, 2]>(x)", 13),
        ("a = Constant<value = int64[2] {2, -2}>()\n y = ReduceSum(x, a)", 13),
    ],
)
def test_a_reduction_over_unit_axes_is_its_input(body, opset):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (float[N, 1, 1] xin) => (float[N, 1, 1] y) {{
          x = Relu(xin)
          {body}
        }}
        """
    )
    out, result = run_passes(proto, ["lift-constants", "identity", "dead-code"])
    assert rules_fired(result).get("reduce-unit-axes") == 1, rules_fired(result)
    assert op_types(out) == ["Relu"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("body", "out_type", "opset"),
    [
        ("y = ReduceProd<axes = [0]>(x)", "float[1, 1, 1]", 17),  # N may be more than 1
        ("y = ReduceSum<axes = [1], keepdims = 0>(x)", "float[N, 1]", 11),  # drops the axis
        ("y = ReduceSum(x, a)", "float[N, 1, 1]", 13),  # axes not constant
        ("y = ReduceMean(x)", "float[1, 1, 1]", 13),  # every axis, N among them
        ("y = ReduceL2<axes = [1]>(x)", "float[N, 1, 1]", 13),  # |x|, not x
    ],
)
def test_a_reduction_that_may_combine_elements_is_kept(body, out_type, opset):
    inputs = "float[N, 1, 1] x" + (", int64[1] a" if "(x, a)" in body else "")
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({inputs}) => ({out_type} y) {{
          {body}
        }}
        """
    )
    out, result = run_passes(proto, ["lift-constants", "identity", "dead-code"])
    assert "reduce-unit-axes" not in rules_fired(result)
    assert len(out.graph.node) == 1
