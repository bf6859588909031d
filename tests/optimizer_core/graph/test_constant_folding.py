"""Constant folding: each rule fires, the growth budget holds, results are unchanged, the
checker passes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.parser
import pytest

from graphtrim.errors import GraphtrimError
from graphtrim.graph.framework import OptimizeOptions
from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes
from tests.optimizer_core.graph.rule_examples.constant_folding import pooled as pooled_model

PASSES = ["lift-constants", "constant-folding", "dead-code"]


def fired(result) -> dict[str, int]:
    """The rules the constant-folding pass fired (lift-constants and dead-code fire too)."""
    return result.log.per_pass().get("constant-folding", {}).get("rules", {})


def _inits(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str]:
    return [
        d.dim_param if d.HasField("dim_param") else d.dim_value
        for d in value_info.type.tensor_type.shape.dim
    ]


def test_constant_subgraph_folded_to_an_initializer():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Constant<value = float[4] {1, 2, 3, 4}>()
          b = Constant<value = float[4] {0.5, 0.5, 0.5, 0.5}>()
          c = Mul(a, b)
          d = Sqrt(c)
          e = Neg(d)
          y = Add(x, e)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"fold": 1}
    assert op_types(out) == ["Add"]
    (name,) = _inits(out)
    np.testing.assert_array_equal(
        _inits(out)[name], -np.sqrt(np.array([1, 2, 3, 4], np.float32) * np.float32(0.5))
    )
    assert list(out.graph.node[0].input) == ["x", name]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_constant_subgraph_read_twice_folded_once_per_frontier_value():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) <float[4] w = {1, 2, 3, 4}> {
          a = Neg(w)
          b = Abs(a)
          c = Sqrt(b)
          p = Mul(x, a)
          q = Add(p, c)
          y = Sub(q, b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    # a, b and c are all read outside the constant part: three folded values
    assert fired(result) == {"fold": 3}
    assert op_types(out) == ["Mul", "Add", "Sub"]
    assert len(out.graph.initializer) == 3
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_static_shape_arithmetic_folded():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[6, 4] y) {
          s = Shape(x)
          i0 = Constant<value = int64 {0}>()
          i1 = Constant<value = int64 {1}>()
          i2 = Constant<value = int64 {2}>()
          d0 = Gather<axis = 0>(s, i0)
          d1 = Gather<axis = 0>(s, i1)
          d2 = Gather<axis = 0>(s, i2)
          m = Mul(d0, d1)
          ax = Constant<value = int64[1] {0}>()
          u0 = Unsqueeze(m, ax)
          u1 = Unsqueeze(d2, ax)
          shp = Concat<axis = 0>(u0, u1)
          y = Reshape(x, shp)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    # Shape(x) becomes a constant, then the whole computation is evaluated at once
    assert fired(result) == {"shape": 1, "fold": 1}
    assert op_types(out) == ["Reshape"]
    shape_name = out.graph.node[0].input[1]
    assert _inits(out)[shape_name].tolist() == [6, 4]
    assert_equivalent(proto, out)


def test_gather_of_a_static_dim_folded_while_the_batch_stays_symbolic():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          s = Shape(x)
          i = Constant<value = int64 {1}>()
          d = Gather<axis = 0>(s, i)
          f = Cast<to = 1>(d)
          y = Div(x, f)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    rules = fired(result)
    assert rules["gather-shape"] == 1
    assert "shape" not in rules  # Shape(x) itself has a symbolic dim
    assert op_types(out) == ["Div"]
    assert [_dims(v) for v in out.graph.input] == [["N", 4]]
    assert [_dims(v) for v in out.graph.output] == [["N", 4]]
    (value,) = _inits(out).values()
    assert value.dtype == np.float32 and value.shape == () and float(value) == 4.0
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_gather_of_a_symbolic_dim_kept():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          s = Shape(x)
          i = Constant<value = int64 {0}>()
          d = Gather<axis = 0>(s, i)
          f = Cast<to = 1>(d)
          y = Div(x, f)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result).get("gather-shape")
    assert op_types(out) == ["Shape", "Gather", "Cast", "Div"]
    assert [_dims(v) for v in out.graph.input] == [["N", 4]]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("start", "end", "expected"), [(1, None, [3, 4]), (-1, None, [4]), (0, 1, None)]
)
def test_shape_with_start_and_end(start, end, expected):
    attrs = f"start = {start}" + (f", end = {end}" if end is not None else "")
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 3, 4] x) => (int64[K] y) {{
          s = Shape<{attrs}>(x)
          y = Neg(s)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    if expected is None:
        assert not fired(result)
        assert op_types(out) == ["Shape", "Neg"]
    else:
        assert fired(result)["shape"] == 1
        # Neg of the folded shape is constant too, but it is the graph output: it stays a node
        assert op_types(out) == ["Neg"]
        assert _inits(out)[out.graph.node[0].input[0]].tolist() == expected
    assert_equivalent(proto, out, dim_values={"N": 5})


def test_size_of_a_static_shape_folded():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3, 4] x) => (float[3, 4] y) {
          n = Size(x)
          f = Cast<to = 1>(n)
          y = Mul(x, f)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"size": 1, "fold": 1}
    assert op_types(out) == ["Mul"]
    (value,) = _inits(out).values()
    assert float(value) == 12.0
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- the growth budget


def _constant_of_shape_model(shape: list[int]) -> onnx.ModelProto:
    dims = ", ".join(str(d) for d in shape)
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{dims}] x) => (float[{dims}] y) {{
          s = Constant<value = int64[{len(shape)}] {{{dims}}}>()
          c = ConstantOfShape<value = float[1] {{1.5}}>(s)
          y = Add(x, c)
        }}
        """
    )


def test_large_constant_of_shape_not_folded():
    proto = _constant_of_shape_model([1000, 1000])
    out, result = run_passes(proto, PASSES)
    rules = fired(result)
    assert "fold" not in rules
    assert rules["skipped-over-budget"] >= 1
    assert op_types(out) == ["ConstantOfShape", "Add"]
    # the 16-byte shape stays the only constant data
    assert sum(v.nbytes for v in _inits(out).values()) == 16
    assert_equivalent(proto, out)


def test_small_constant_of_shape_folded():
    proto = _constant_of_shape_model([2, 3])
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"fold": 1}
    assert op_types(out) == ["Add"]
    (value,) = _inits(out).values()
    np.testing.assert_array_equal(value, np.full((2, 3), 1.5, np.float32))
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("growth", "folded"), [(0, False), (4096, True)], ids=["budget-0", "budget-4096"]
)
def test_fold_max_growth_bytes_option(growth, folded):
    # 2 x 100 floats = 800 bytes from a 16-byte shape: within the default budget, not within 0
    proto = _constant_of_shape_model([2, 100])
    out, result = run_passes(proto, PASSES, options=OptimizeOptions(fold_max_growth_bytes=growth))
    rules = fired(result)
    if folded:
        assert rules == {"fold": 1}
        assert op_types(out) == ["Add"]
    else:
        assert "fold" not in rules and rules["skipped-over-budget"] >= 1
        assert op_types(out) == ["ConstantOfShape", "Add"]
    assert_equivalent(proto, out)


def test_fold_max_growth_bytes_lets_a_large_tensor_fold():
    proto = _constant_of_shape_model([100, 100])
    out, result = run_passes(proto, PASSES)
    assert "fold" not in fired(result)
    assert op_types(out) == ["ConstantOfShape", "Add"]
    out, result = run_passes(proto, PASSES, options=OptimizeOptions(fold_max_growth_bytes=1 << 20))
    assert fired(result) == {"fold": 1}
    assert op_types(out) == ["Add"]
    assert_equivalent(proto, out)


def _weight_model(shared: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64)).astype(np.float32)  # 8 KiB: over the growth budget
    extra = "z = MatMul(x2, w)" if shared else ""
    outputs = "float[N, 32] y, float[N, 64] z" if shared else "float[N, 32] y"
    inputs = "float[N, 64] x, float[N, 32] x2" if shared else "float[N, 64] x"
    proto = onnx.parser.parse_model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({inputs}) => ({outputs}) {{
          wt = Transpose<perm = [1, 0]>(w)
          y = MatMul(x, wt)
          {extra}
        }}
        """
    )
    proto.graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def test_transpose_of_a_weight_used_only_there_folded():
    proto = _weight_model(shared=False)
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"fold": 1}
    assert op_types(out) == ["MatMul"]
    ((name, value),) = _inits(out).items()
    np.testing.assert_array_equal(value, _inits(proto)["w"].T)
    assert out.graph.node[0].input[1] == name
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_transpose_of_a_shared_weight_not_folded():
    # the weight stays for the other MatMul: folding would add 8 KiB
    proto = _weight_model(shared=True)
    out, result = run_passes(proto, PASSES)
    rules = fired(result)
    assert "fold" not in rules and rules["skipped-over-budget"] >= 1
    assert op_types(out) == ["Transpose", "MatMul", "MatMul"]
    assert list(_inits(out)) == ["w"]
    assert_equivalent(proto, out, dim_values={"N": 3})


# ---------------------------------------------------------------- never folded


def test_dequantize_linear_of_a_constant_not_folded():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) <int8[4] q = {1, -2, 3, -4}, float s = {0.5}, int8 zp = {0}> {
          d = DequantizeLinear(q, s, zp)
          y = Add(x, d)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert "fold" not in fired(result)
    assert op_types(out) == ["DequantizeLinear", "Add"]
    assert sorted(_inits(out)) == ["q", "s", "zp"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    "random",
    [
        "r = RandomUniform<shape = [4], seed = 1.0>()",
        "r = RandomNormal<shape = [4], seed = 1.0>()",
        "c = Constant<value = float[4] {1, 2, 3, 4}>()\n r = RandomUniformLike<seed = 1.0>(c)",
        "c = Constant<value = float[4] {0.1, 0.2, 0.9, 1}>()\n r = Bernoulli<seed = 1.0>(c)",
    ],
    ids=["uniform", "normal", "uniform-like", "bernoulli"],
)
def test_random_ops_not_folded(random):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {{
          {random}
          y = Add(x, r)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert "fold" not in fired(result)
    op = random.split("r = ")[-1].split("<")[0]
    assert op in op_types(out)
    assert op_types(out)[-1] == "Add"
    onnx.checker.check_model(out, full_check=True)


def test_graph_output_not_folded():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] z) {
          a = Constant<value = float[4] {1, 2, 3, 4}>()
          z = Neg(a)
          y = Add(x, z)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert "fold" not in fired(result)
    assert op_types(out) == ["Neg", "Add"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_equivalent(proto, out)


def test_overridable_initializer_not_folded():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] w) => (float[4] y) <float[4] w = {1, 2, 3, 4}> {
          a = Neg(w)
          y = Add(x, a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not fired(result)
    assert op_types(out) == ["Neg", "Add"]
    assert_equivalent(proto, out)


def test_folding_inside_a_subgraph():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, bool c) => (float[4] y) <float[4] w = {1, 2, 3, 4}> {
          y = If(c) <
            then_branch = t () => (float[4] ty) {
              a = Neg(w)
              b = Exp(a)
              ty = Add(x, b)
            },
            else_branch = e () => (float[4] ey) {
              ey = Sub(x, w)
            }
          >
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert fired(result) == {"fold": 1}
    then = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == ["Add"]
    for c in (True, False):
        feeds = [{"x": np.arange(4, dtype=np.float32), "c": np.array(c)}]
        assert_equivalent(proto, out, inputs=feeds)


def test_a_uniform_value_over_the_budget_is_a_fill_and_its_zero_sum_goes():
    """A gathered zero bias table is over the growth budget but all zeros: it becomes a fill,
    and x + 0 then goes (default preset)."""
    from tests.optimizer_core.graph.rule_examples.constant_folding import _uniform_gather

    proto = _uniform_gather()
    out, result = run_passes(proto)
    fired = rules_fired(result)
    assert fired.get("fill") == 1 and fired.get("x+0") == 1
    assert op_types(out) == ["Softmax"]
    assert sum(len(t.raw_data) for t in out.graph.initializer) < 1024  # nothing materialized
    assert_equivalent(proto, out, dim_values={"N": 2})


def test_a_value_over_the_budget_that_is_no_fill_stays_and_is_evaluated_once():
    from tests.optimizer_core.graph.rule_examples.constant_folding import _uniform_gather

    proto = _uniform_gather()
    table = next(t for t in proto.graph.initializer if t.name == "table")
    table.CopyFrom(
        onnx.numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(16, 4), "table")
    )
    out, result = run_passes(proto)
    assert "GatherND" in op_types(out) and "fill" not in rules_fired(result)
    records = [r for r in result.log.records if r.pass_name == "constant-folding"]
    assert sum(r.rules.get("skipped-over-budget", 0) for r in records) >= 1
    assert_equivalent(proto, out, dim_values={"N": 2})


@pytest.mark.parametrize(
    ("c", "decided"),
    [("{-1, -1, -1}", True), ("{3, -1, -1}", False), ("{-1, 0, 5}", True)],
    ids=["negative", "a-dim-against-a-size", "static-entries"],
)
def test_a_shape_compared_entry_by_entry_is_decided_only_where_provable(c, decided):
    """``Equal`` of [B, 1, 5] (B read from x) with a constant: a dim is never negative, a
    static entry is compared, and a dim against a non-negative size is left to run time."""
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, 4] x) => (bool[3] y, float[B, 4] z)
          <int64 i0 = {{0}}, int64[1] ax = {{0}}, int64[2] tail = {{1, 5}}, int64[3] c = {c}> {{
          s = Shape(x)
          b = Gather<axis = 0>(s, i0)
          bu = Unsqueeze(b, ax)
          t = Concat<axis = 0>(bu, tail)
          e = Equal(t, c)
          y = Not(e)
          z = Relu(x)
        }}
        """
    )
    out, result = run_passes(proto, ["constant-folding"])
    assert ("equal-dims" in rules_fired(result)) == decided
    assert_equivalent(proto, out, dim_values={"B": 3})


# ---------------------------------------------------------------- the run's growth pool


@pytest.mark.parametrize(
    ("ratio", "pooled"), [(0.0, 0), (0.01, 1), (0.02, 2)], ids=["off", "one", "both"]
)
def test_growth_pool_is_shared_by_the_run(ratio, pooled):
    # two 8 KiB tilings beside 1 MiB of weights: 1% holds one of them, 2% both
    proto = pooled_model(tiles=2)
    out, result = run_passes(proto, PASSES, options=OptimizeOptions(fold_max_growth_ratio=ratio))
    rules = fired(result)
    assert rules.get("fold-pooled", 0) == pooled
    assert op_types(out).count("Tile") == 2 - pooled
    if pooled < 2:
        assert rules["skipped-over-budget"] >= 1
    grown = sum(v.nbytes for v in _inits(out).values()) - sum(
        v.nbytes for v in _inits(proto).values()
    )
    assert grown <= ratio * 1024 * 1024
    assert_equivalent(proto, out)


def test_growth_pool_ratio_out_of_range_is_refused():
    with pytest.raises(GraphtrimError, match="fold_max_growth_ratio"):
        OptimizeOptions(fold_max_growth_ratio=1.5)


def test_dims_arithmetic_folds_only_what_holds_for_every_value_of_the_dims():
    """``B / 4`` and ``B - S`` depend on the dims' values: left to run; ``(4*B) / B`` is 4 and
    ``S - S`` is 0 for every B and S."""
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B, S] x, float[B, S] m) => (float[B, S] y)
          <int64 i0 = {0}, int64 i1 = {1}, int64 four = {4}> {
          sx = Shape(x)
          b = Gather<axis = 0>(sx, i0)
          s = Gather<axis = 0>(sx, i1)
          q = Div(b, four)
          d = Sub(b, s)
          e = Add(q, d)
          f = Cast<to = 1>(e)
          y = Add(x, f)
        }
        """
    )
    out, result = run_passes(proto, ["constant-folding"])
    assert {"div-dims", "sub-dims"}.isdisjoint(rules_fired(result))
    assert {"Div", "Sub"} <= set(op_types(out))
    assert_equivalent(proto, out, dim_values={"B": 8, "S": 3})
