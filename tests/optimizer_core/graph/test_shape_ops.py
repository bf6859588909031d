"""Shape arithmetic and reshaping chains: rules found on exported transformers."""

from __future__ import annotations

import pytest

from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes


def test_scalar_gather_of_shape_folds_to_a_scalar():
    # a 0-d index must give a 0-d constant (a 1-d one broke a later Concat)
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4, 6] x) => (float[N, 4, 6] y) {
          s = Shape(x)
          i = Constant<value = int64 {2}>()
          d = Gather<axis = 0>(s, i)
          a = Constant<value = int64[1] {0}>()
          du = Unsqueeze(d, a)
          m = Constant<value = int64[1] {-1}>()
          f = Constant<value = int64[1] {4}>()
          shp = Concat<axis = 0>(m, f, du)
          y = Reshape(x, shp)
        }
        """
    )
    # symbolic-shapes would take the Reshape first (its dim N is copied): leave this to folding
    out, result = run_passes(proto, skip=["symbolic-shapes"])
    assert rules_fired(result).get("gather-shape", 0) >= 1
    # the whole shape computation folds; the Reshape reading an input stays (y must keep its name)
    assert op_types(out) == ["Reshape"]
    assert out.graph.node[0].input[1] in {i.name for i in out.graph.initializer}
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("start", "end", "expect_folded"),
    [
        (-1, 9223372036854775807, True),
        (1, 3, True),
        (0, 1, False),
        (-9223372036854775808, -2, False),
    ],
)
def test_slice_of_shape_folds_when_the_dims_are_static(start, end, expect_folded):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4, 6] x) => (int64[K] y) {{
          s = Shape(x)
          st = Constant<value = int64[1] {{{start}}}>()
          en = Constant<value = int64[1] {{{end}}}>()
          y0 = Slice(s, st, en)
          y = Identity(y0)
        }}
        """
    )
    out, result = run_passes(proto, ["lift-constants", "constant-folding", "identity", "dead-code"])
    assert (rules_fired(result).get("slice-shape", 0) >= 1) == expect_folded
    if expect_folded:
        assert "Slice" not in op_types(out)
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("inner", "outer"), [("{0, 1}", "{3}"), ("{0}", "{0}"), ("{1}", "{-1}"), ("{-1}", "{0, 2}")]
)
def test_consecutive_unsqueezes_compose(inner, outer):
    rank = 2 + inner.count(",") + 1 + outer.count(",") + 1
    dims = ", ".join("ABCDEFG"[:rank])
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[{dims}] y) {{
          a = Constant<value = int64[{inner.count(",") + 1}] {inner}>()
          b = Constant<value = int64[{outer.count(",") + 1}] {outer}>()
          r = Relu(x)
          u = Unsqueeze(r, a)
          y = Unsqueeze(u, b)
        }}
        """
    )
    out, result = run_passes(proto)
    assert op_types(out) == ["Relu", "Unsqueeze"]
    assert rules_fired(result)["unsqueeze-unsqueeze"] == 1
    assert_equivalent(proto, out)
