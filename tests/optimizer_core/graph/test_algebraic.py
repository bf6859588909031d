"""Algebraic simplification (exact) and reassociation (rounds differently): each rule fires,
results are unchanged (within an ulp for reassociation), the checker passes."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from graphtrim.graph.passes.algebraic import AlgebraicSimplification
from graphtrim.graph.presets import PASSES, PRESETS
from tests.helpers import (
    assert_equivalent,
    op_types,
    ort_kernels,
    parse,
    rules_fired,
    run_passes,
    written_out_layernorm,
)

ALGEBRAIC = ["lift-constants", "algebraic", "dead-code"]
REASSOCIATE = ["lift-constants", "reassociate", "dead-code"]


def fired(result, pass_name: str = "algebraic") -> dict[str, int]:
    """The rules one pass fired (lift-constants and dead-code fire too)."""
    return result.log.per_pass().get(pass_name, {}).get("rules", {})


# ---------------------------------------------------------------- neutral elements


@pytest.mark.parametrize(
    ("expr", "rule"),
    [
        ("y = Add(x, c)", "x+0"),
        ("y = Add(c, x)", "0+x"),
        ("y = Sub(x, c)", "x-0"),
        ("y = Mul(x, c)", "x*1"),
        ("y = Mul(c, x)", "1*x"),
        ("y = Div(x, c)", "x/1"),
        ("y = Pow(x, c)", "x**1"),
    ],
    ids=["x+0", "0+x", "x-0", "x*1", "1*x", "x/1", "x**1"],
)
@pytest.mark.parametrize(
    "const_shape", ["", "[1]", "[4]", "[1, 4]"], ids=["scalar", "1", "row", "1x4"]
)
def test_neutral_element_removed(expr, rule, const_shape):
    neutral = 0 if rule in ("x+0", "0+x", "x-0") else 1
    count = {"": 1, "[1]": 1, "[4]": 4, "[1, 4]": 4}[const_shape]
    values = ", ".join([str(neutral)] * count)
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {{
          x = Neg(xin)
          c = Constant<value = float{const_shape} {{{values}}}>()
          {expr}
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {rule: 1}
    assert op_types(out) == ["Neg"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert len(out.graph.initializer) == 0
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("dtype", "expr", "rule"),
    [
        ("int32", "y = Add(x, c)", "x+0"),
        ("int64", "y = Mul(c, x)", "1*x"),
        ("int32", "y = Div(x, c)", "x/1"),
        ("int64", "y = Sub(x, c)", "x-0"),
        ("double", "y = Mul(x, c)", "x*1"),
        ("float16", "y = Add(c, x)", "0+x"),
    ],
    ids=["int32-add", "int64-mul", "int32-div", "int64-sub", "double-mul", "float16-add"],
)
def test_neutral_element_removed_for_other_dtypes(dtype, expr, rule):
    neutral = 0 if rule in ("x+0", "0+x", "x-0") else 1
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({dtype}[N, 4] xin) => ({dtype}[N, 4] y) {{
          x = Abs(xin)
          c = Constant<value = {dtype} {{{neutral}}}>()
          {expr}
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {rule: 1}
    assert op_types(out) == ["Abs"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_pow_with_int_exponent_one_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {
          x = Neg(xin)
          c = Constant<value = int64 {1}>()
          y = Pow(x, c)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"x**1": 1}
    assert op_types(out) == ["Neg"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("x_type", "const", "out_type"),
    [
        ("float[4]", "float[3, 4] {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}", "float[3, 4]"),
        ("float[1, 4]", "float[3, 1] {0, 0, 0}", "float[3, 4]"),
        ("float[N, 4]", "float[2, 1, 1] {0, 0}", "float[2, N, 4]"),
        ("float", "float[2] {0, 0}", "float[2]"),
    ],
    ids=["rows", "columns", "new-leading-dim", "scalar-x"],
)
def test_neutral_constant_that_broadcasts_x_larger_is_kept(x_type, const, out_type):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({x_type} x) => ({out_type} y) {{
          c = Constant<value = {const}>()
          y = Add(x, c)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert op_types(out) == ["Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_neutral_constant_with_symbolic_dim_match_is_kept():
    # c of shape [4] against x of shape [K] keeps x's shape only when K == 4: not provable
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[K] x) => (float[4] y) {
          c = Constant<value = float[4] {1, 1, 1, 1}>()
          y = Mul(x, c)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert op_types(out) == ["Mul"]
    assert_equivalent(proto, out, dim_values={"K": 1})


@pytest.mark.parametrize(
    "expr",
    [
        "y = Sub(c, x)",  # 0 - x is Neg
        "y = Div(c, x)",  # 1 / x is Reciprocal
        "y = Pow(c, x)",  # 1 ** x
    ],
    ids=["0-x", "1/x", "1**x"],
)
def test_neutral_constant_on_the_wrong_side_is_kept(expr):
    value = 0 if "Sub" in expr else 1
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          c = Constant<value = float {{{value}}}>()
          {expr}
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert len(out.graph.node) == 1
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    "const", ["float[4] {0, 0, 0, 0.5}", "float {1}"], ids=["not-all-zero", "one-not-zero"]
)
def test_non_neutral_constant_is_kept(const):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {{
          c = Constant<value = {const}>()
          y = Add(x, c)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert op_types(out) == ["Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("expr", "const", "kept"),
    [
        ("And(c, x)", "bool {1}", False),  # an attention mask term that is always true
        ("Or(x, c)", "bool[4] {0, 0, 0, 0}", False),
        ("And(x, c)", "bool[4] {1, 1, 0, 1}", True),  # not all true
        ("Or(c, x)", "bool {1}", True),  # True absorbs: not the neutral element
        ("And(x, c)", "bool[2, 1, 4] {1, 1, 1, 1, 1, 1, 1, 1}", True),  # broadcasts x larger
    ],
    ids=["true-and-x", "x-or-false", "not-all-true", "or-true", "broadcasts"],
)
def test_boolean_neutral_elements(expr, const, kept):
    out_shape = "[2, N, 4]" if "[2, 1, 4]" in const else "[N, 4]"
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (bool[N, 4] xin) => (bool{out_shape} y) {{
          x = Not(xin)
          c = Constant<value = {const}>()
          y = {expr}
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert bool(fired(result)) is not kept
    assert op_types(out) == (["Not", expr[: expr.index("(")]] if kept else ["Not"])
    assert_equivalent(proto, out, dim_values={"N": 3})


def _fresh_layernorm(opset: int, square: str = "Pow") -> onnx.ModelProto:
    """A LayerNormalization written out op by op with the weights a fresh model has: the scale
    all ones, the shift all zeros."""
    body = written_out_layernorm("x")
    if square != "Pow":
        body = body.replace("sq = Pow(d, two)", "sq = Mul(d, d)")
    proto = onnx.parser.parse_model(
        f"""<ir_version: 8, opset_import: ["" : {opset}]>
        g (float[batch, 16, 32] x) => (float[batch, 16, 32] y) {{
            {body}
            ng = Mul(n, g)
            y = Add(ng, b)
        }}"""
    )
    consts = {
        "g": np.ones(32, np.float32),
        "b": np.zeros(32, np.float32),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-5, np.float32),
    }
    proto.graph.initializer.extend(onnx.numpy_helper.from_array(a, k) for k, a in consts.items())
    onnx.checker.check_model(proto, full_check=True)
    return proto


def test_the_scale_of_a_written_out_layernorm_stays_where_onnxruntime_fuses_it(tmp_path):
    """Below opset 17, onnxruntime fuses a written-out normalization into one kernel only up to
    its scale ``Mul``: all ones, it stays (the shift of zeros goes), and the centered value is
    normalized by SimplifiedLayerNormalization instead of six ops."""
    proto = _fresh_layernorm(13)
    out, result = run_passes(proto)
    assert "x*1" not in rules_fired(result) and rules_fired(result).get("x+0") == 1
    assert op_types(out).count("Mul") == 1
    assert_equivalent(proto, out, dim_values={"batch": 2})
    path = tmp_path / "out.onnx"
    onnx.save(out, path)
    kernels = ort_kernels(path)
    assert "SimplifiedLayerNormalization" in kernels
    assert not {"Pow", "Sqrt", "Div"} & set(kernels)


@pytest.mark.parametrize(("opset", "square"), [(13, "Mul"), (17, "Pow")])
def test_the_scale_of_ones_goes_where_no_fusion_needs_it(opset, square):
    # onnxruntime matches only the Pow form; from opset 17 the pattern is one op of graphtrim's
    out, result = run_passes(_fresh_layernorm(opset, square))
    ops = op_types(out)
    if opset >= 17:
        assert ops == ["LayerNormalization"]
    else:
        assert rules_fired(result).get("x*1") == 1
        assert ops.count("Mul") == 1  # the square
    assert_equivalent(_fresh_layernorm(opset, square), out, dim_values={"batch": 2})


def _with_expands(proto: onnx.ModelProto, count: int = 4) -> onnx.ModelProto:
    """``proto`` with its output run through ``count`` rounds of ``Relu(Expand(v, Shape(v)))``:
    an Expand to the value's own shape, which onnxruntime runs and graphtrim removes."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    v = out.graph.output[0].name
    for i in range(count):
        out.graph.node.extend(
            [
                onnx.helper.make_node("Shape", [v], [f"s{i}"]),
                onnx.helper.make_node("Expand", [v, f"s{i}"], [f"e{i}"]),
                onnx.helper.make_node("Relu", [f"e{i}"], [f"r{i}"]),
            ]
        )
        v = f"r{i}"
    out.graph.output[0].name = v
    onnx.checker.check_model(out, full_check=True)
    return out


def _with_work(proto: onnx.ModelProto, layers: int) -> onnx.ModelProto:
    """``proto`` with its output run through matrix products, ``[.., 32] x [32, 1024]`` and
    ``layers`` of ``[.., 1024] x [1024, 1024]``: 1 M + 33.5 M multiply-adds per layer for the
    32 rows at batch 2, the work of a model whose normalizations weigh little."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    rng = np.random.default_rng(0)
    v = out.graph.output[0].name
    for i, (k, n) in enumerate([(32, 1024)] + [(1024, 1024)] * layers):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        out.graph.initializer.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        out.graph.node.append(onnx.helper.make_node("MatMul", [v, f"w{i}"], [f"p{i}"]))
        v = f"p{i}"
    del out.graph.output[:]
    out.graph.output.append(
        onnx.helper.make_tensor_value_info(v, onnx.TensorProto.FLOAT, ["batch", 16, 1024])
    )
    onnx.checker.check_model(out, full_check=True)
    return out


@pytest.mark.parametrize("case", ["alone", "with-savings", "with-work", "with-both"])
def test_the_file_keeps_the_scales_only_where_onnxruntime_would_run_more_kernels(tmp_path, case):
    """``graphtrim optimize`` drops the kept scales of ones unless onnxruntime, without them,
    would run more kernels for the result than for the input, and those kernels weigh in the
    input's time. A normalization alone would go from one kernel to seven: it stays, with a
    shift of zeros, and onnxruntime runs it as one LayerNormalization, as the input. Beside
    four Expands graphtrim removes, it pays for itself. Before 102 M multiply-adds (340
    kernels' worth at 300,000 each), even six kernels more are under 2% of the time: not
    counted. Beside an Expand and 68 M multiply-adds, the four kernels it adds are 1.7%."""
    from graphtrim.optimize_file import optimize_file

    proto = _fresh_layernorm(13)
    if case == "with-savings":
        proto = _with_expands(proto)
    elif case == "with-work":
        proto = _with_work(proto, layers=3)
    elif case == "with-both":
        proto = _with_work(_with_expands(proto, count=1), layers=2)
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, src)
    report = optimize_file(src, dst, check=True, dim_values={"batch": 2})
    out = onnx.load(str(dst))
    notes = [n for n in report.log.notes if "scale" in n]
    if case == "alone":
        # the scale stays, with a shift of zeros: onnxruntime fuses the whole LayerNormalization
        assert op_types(out).count("Mul") == 1 and op_types(out).count("Add") == 2
        assert notes and notes[0].startswith("kept 1 normalization scale(s) of ones")
        assert "7 kernels for the result against 1 for the input" in notes[0]
        assert "with a shift of zeros after 1 of them" in notes[0]
        assert ort_kernels(dst) == ["LayerNormalization"]
    else:
        assert "Mul" not in op_types(out)
    if case == "with-savings":
        assert not notes
    elif case == "with-work":
        assert notes and notes[0].startswith("dropped 1 normalization scale(s) of ones")
        assert "at most 6 kernels each, under 1.8% of the input's time" in notes[0]
    elif case == "with-both":
        assert notes and notes[0].startswith("dropped 1 normalization scale(s) of ones")
        assert "11 kernels for the result against 7 for the input (about 1.7%" in notes[0]
    assert_equivalent(proto, out, dim_values={"batch": 2}, rtol=0 if case == "alone" else 1e-5)


def test_a_kept_rms_scale_gets_no_shift(tmp_path):
    """The mean-of-squares form has no shift: onnxruntime's SimplifiedLayerNormFusion ends at
    the scale, so the file keeps the scale alone and onnxruntime runs one kernel."""
    from graphtrim.optimize_file import optimize_file

    proto = onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 13]>
        g (float[batch, 16, 32] x) => (float[batch, 16, 32] y) {
            sq = Pow(x, two)
            v = ReduceMean<axes = [-1]>(sq)
            ve = Add(v, eps)
            sd = Sqrt(ve)
            n = Div(x, sd)
            y = Mul(n, g)
        }"""
    )
    consts = {
        "g": np.ones(32, np.float32),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-6, np.float32),
    }
    proto.graph.initializer.extend(onnx.numpy_helper.from_array(a, k) for k, a in consts.items())
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(proto, src)
    report = optimize_file(src, dst, check=True, dim_values={"batch": 2})
    notes = [n for n in report.log.notes if "scale" in n]
    assert notes and notes[0].startswith("kept 1 normalization scale(s) of ones")
    assert "shift" not in notes[0]
    out = onnx.load(str(dst))
    assert op_types(out).count("Mul") == 1 and op_types(out).count("Add") == 1
    assert ort_kernels(dst) == ["SimplifiedLayerNormalization"]
    assert_equivalent(proto, out, dim_values={"batch": 2})


def test_overridable_zero_initializer_is_not_a_constant():
    # an initializer listed as a graph input may be fed another value at run time
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x, float c) => (float[N, 4] y) <float c = {0}> {
          y = Add(x, c)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert op_types(out) == ["Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_neutral_element_on_a_graph_input_feeding_the_output():
    # y = x + 0 with x a graph input: the output cannot be renamed onto an input, so it stays
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) {
          c = Constant<value = float {0}>()
          y = Add(x, c)
          a = Add(x, c)
          z = Neg(a)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"x+0": 1}
    assert op_types(out) == ["Add", "Neg"]
    assert list(out.graph.node[1].input) == ["x"]
    assert_equivalent(proto, out, dim_values={"N": 3})


# ---------------------------------------------------------------- involutions


@pytest.mark.parametrize(
    ("dtype", "op", "rule"),
    [
        ("float", "Neg", "neg-neg"),
        ("int32", "Neg", "neg-neg"),
        ("int64", "Neg", "neg-neg"),
        ("bool", "Not", "not-not"),
    ],
    ids=["neg-float", "neg-int32", "neg-int64", "not-bool"],
)
def test_double_involution_removed(dtype, op, rule):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({dtype}[N, 4] x) => ({dtype}[N, 4] y) {{
          a = Identity(x)
          b = {op}(a)
          c = {op}(b)
          y = Identity(c)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {rule: 1}
    assert op_types(out) == ["Identity", "Identity"]
    assert list(out.graph.node[1].input) == ["a"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_triple_neg_keeps_one():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Neg(x)
          b = Neg(a)
          y = Neg(b)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"neg-neg": 1}
    assert op_types(out) == ["Neg"]
    assert_equivalent(proto, out, dim_values={"N": 3})


# ---------------------------------------------------------------- Transpose pairs


@pytest.mark.parametrize(
    ("p", "q"),
    [([1, 0, 2], [1, 0, 2]), ([1, 2, 0], [2, 0, 1]), ([2, 0, 1], [1, 2, 0])],
    ids=["swap", "rotate", "rotate-back"],
)
def test_transpose_pair_cancelled(p, q):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] xin) => (float[2, 3, 4] y) {{
          x = Neg(xin)
          a = Transpose<perm = {p}>(x)
          y = Transpose<perm = {q}>(a)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"transpose-transpose-cancel": 1}
    assert op_types(out) == ["Neg"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out)


def test_transpose_pair_without_perm_cancelled():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] xin) => (float[2, 3, 4] y) {
          x = Neg(xin)
          a = Transpose(x)
          y = Transpose(a)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"transpose-transpose-cancel": 1}
    assert op_types(out) == ["Neg"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("p", "q", "composed", "out_shape"),
    [
        ([1, 0, 2], [0, 2, 1], [1, 2, 0], "[3, 4, 2]"),
        ([1, 2, 0], [1, 2, 0], [2, 0, 1], "[4, 2, 3]"),
        ([0, 2, 1], [2, 1, 0], [1, 2, 0], "[3, 4, 2]"),
        (None, [1, 0, 2], [1, 2, 0], "[3, 4, 2]"),
        ([0, 2, 1], None, [1, 2, 0], "[3, 4, 2]"),
    ],
    ids=["swap-then-swap", "rotate-twice", "swap-then-reverse", "default-inner", "default-outer"],
)
def test_transpose_pair_composed(p, q, composed, out_shape):
    def transpose(perm):
        return "Transpose" if perm is None else f"Transpose<perm = {perm}>"

    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float{out_shape} y) {{
          a = {transpose(p)}(x)
          y = {transpose(q)}(a)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"transpose-transpose-compose": 1}
    assert op_types(out) == ["Transpose"]
    (node,) = out.graph.node
    assert list(node.input) == ["x"]
    assert list(node.attribute[0].ints) == composed
    assert_equivalent(proto, out)


def test_transpose_pair_with_shared_inner_keeps_the_inner():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[2, 3, 4] y, float[3, 2, 4] z) {
          a = Transpose<perm = [1, 0, 2]>(x)
          b = Transpose<perm = [1, 0, 2]>(a)
          y = Neg(b)
          z = Abs(a)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"transpose-transpose-cancel": 1}
    assert op_types(out) == ["Transpose", "Neg", "Abs"]
    assert list(out.graph.node[1].input) == ["x"]
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- Reshape chains


@pytest.mark.parametrize(
    ("inner", "rule"),
    [
        ("s1 = Constant<value = int64[2] {6, 4}>()\n a = Reshape(x, s1)", "reshape-reshape"),
        ("a = Flatten<axis = 2>(x)", "flatten-reshape"),
        ("ax = Constant<value = int64[1] {1}>()\n a = Unsqueeze(x, ax)", "unsqueeze-reshape"),
        # the Squeeze merges into the Reshape before it (reshape-squeeze), which the outer one
        # then takes (reshape-reshape)
        ("ax = Constant<value = int64[1] {0}>()\n a = Squeeze(x1, ax)", "reshape-squeeze"),
    ],
    ids=["reshape", "flatten", "unsqueeze", "squeeze"],
)
def test_reshape_chain_collapsed(inner, rule):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] xin) => (float[4, 6] y) {{
          x = Neg(xin)
          s0 = Constant<value = int64[4] {{1, 2, 3, 4}}>()
          x1 = Reshape(x, s0)
          {inner}
          s = Constant<value = int64[2] {{4, -1}}>()
          y = Reshape(a, s)
        }}
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result).get(rule) == 1, fired(result)
    # x1 is dead unless the Squeeze read it, and then its Reshape collapses too
    assert op_types(out) == ["Neg", "Reshape"]
    assert out.graph.node[1].input[0] == "x"
    assert_equivalent(proto, out)


def test_reshape_chain_with_zero_in_shape_kept():
    # 0 copies dim 0 of the Reshape's input, N*3, which x does not have there (N): reading x
    # would copy another size
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 3, 4] x) => (float[M, 2, 2] y) {
          s1 = Constant<value = int64[2] {-1, 4}>()
          a = Reshape(x, s1)
          s = Constant<value = int64[3] {0, 2, 2}>()
          y = Reshape(a, s)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert not fired(result)
    assert op_types(out) == ["Reshape", "Reshape"]
    assert_equivalent(proto, out, dim_values={"N": 2})


def test_reshape_chain_with_zero_over_a_dim_the_source_has_collapses():
    # 0 copies N, which x has at the same position: the chain is one Reshape
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 3, 4] x) => (float[N, 12] y) {
          s1 = Constant<value = int64[3] {0, 12, 1}>()
          a = Reshape(x, s1)
          s = Constant<value = int64[2] {0, -1}>()
          y = Reshape(a, s)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"reshape-reshape": 1}
    assert op_types(out) == ["Reshape"]
    assert_equivalent(proto, out, dim_values={"N": 2})


def test_reshape_chain_with_a_zero_over_a_static_dim_collapses():
    # the copied dim is static (6): its size is written, and the chain is one Reshape
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[6, 4] y) {
          s1 = Constant<value = int64[2] {6, 4}>()
          a = Reshape(x, s1)
          s = Constant<value = int64[2] {0, -1}>()
          y = Reshape(a, s)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"reshape-static-copy": 1, "reshape-reshape": 1}
    assert op_types(out) == ["Reshape"]
    assert_equivalent(proto, out)


def test_reshape_chain_of_three_collapsed_int():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[N, 6] x) => (int64[M] y) {
          s1 = Constant<value = int64[3] {-1, 2, 3}>()
          a = Reshape(x, s1)
          s2 = Constant<value = int64[2] {-1, 3}>()
          b = Reshape(a, s2)
          s3 = Constant<value = int64[1] {-1}>()
          y = Reshape(b, s3)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result)["reshape-reshape"] >= 2
    assert op_types(out) == ["Reshape"]
    assert out.graph.node[0].input[0] == "x"
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_unsqueeze_pair_merged():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3, 4] x) => (float[1, 3, 1, 4, 1] y) {
          a1 = Constant<value = int64[1] {1}>()
          a = Unsqueeze(x, a1)
          b1 = Constant<value = int64[2] {0, -1}>()
          y = Unsqueeze(a, b1)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result) == {"unsqueeze-unsqueeze": 1}
    assert op_types(out) == ["Unsqueeze"]
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    assert inits[out.graph.node[0].input[1]].tolist() == [0, 2, 4]
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- reassociate (not exact)


def test_reassociate_is_not_in_the_safe_preset():
    assert not PASSES["reassociate"].exact
    assert "reassociate" not in PRESETS["safe"]
    assert "reassociate" in PRESETS["default"]
    assert "algebraic" in PRESETS["safe"]


@pytest.mark.parametrize(
    ("op", "c1", "c2", "merged"),
    [
        ("Mul", "float {2.0}", "float {3.0}", [6.0]),
        ("Add", "float {0.5}", "float {0.25}", [0.75]),
        ("Mul", "float[4] {1, 2, 3, 4}", "float {0.5}", [0.5, 1.0, 1.5, 2.0]),
        ("Add", "float[1, 4] {1, 2, 3, 4}", "float[4] {4, 3, 2, 1}", [5.0, 5.0, 5.0, 5.0]),
    ],
    ids=["mul-scalars", "add-scalars", "mul-vector-scalar", "add-same-size"],
)
@pytest.mark.parametrize("swap", [False, True], ids=["x-first", "const-first"])
def test_constant_chain_merged(op, c1, c2, merged, swap):
    def call(a, b):
        return f"{op}({b}, {a})" if swap else f"{op}({a}, {b})"

    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {{
          x = Neg(xin)
          c1 = Constant<value = {c1}>()
          c2 = Constant<value = {c2}>()
          a = {call("x", "c1")}
          y = {call("a", "c2")}
        }}
        """
    )
    out, result = run_passes(proto, REASSOCIATE)
    assert fired(result, "reassociate") == {f"{op.lower()}-chain": 1}
    assert op_types(out) == ["Neg", op]
    (init,) = out.graph.initializer
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(init).reshape(-1), merged)
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, rtol=1e-6, dim_values={"N": 3})


def test_long_constant_chain_merged_into_one():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          c1 = Constant<value = float {1.5}>()
          c2 = Constant<value = float {2.0}>()
          c3 = Constant<value = float {-0.25}>()
          a = Mul(x, c1)
          b = Mul(a, c2)
          y = Mul(b, c3)
        }
        """
    )
    out, result = run_passes(proto, REASSOCIATE)
    assert fired(result, "reassociate") == {"mul-chain": 2}
    assert op_types(out) == ["Mul"]
    (init,) = out.graph.initializer
    assert float(onnx.numpy_helper.to_array(init)) == -0.75
    assert_equivalent(proto, out, rtol=1e-6, dim_values={"N": 3})


def test_int_constant_chain_merged_exactly():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int32[N, 4] x) => (int32[N, 4] y) {
          c1 = Constant<value = int32 {7}>()
          c2 = Constant<value = int32[4] {1, 2, 3, 4}>()
          a = Add(x, c1)
          y = Add(a, c2)
        }
        """
    )
    out, result = run_passes(proto, REASSOCIATE)
    assert fired(result, "reassociate") == {"add-chain": 1}
    assert op_types(out) == ["Add"]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    "body",
    [
        # the product would be [3, 4]: larger than either constant
        "c1 = Constant<value = float[3, 1] {1, 2, 3}>()\n"
        " c2 = Constant<value = float[4] {1, 2, 3, 4}>()\n"
        " a = Mul(x, c1)\n y = Mul(a, c2)",
        # different ops do not associate
        "c1 = Constant<value = float {2}>()\n c2 = Constant<value = float {3}>()\n"
        " a = Add(x, c1)\n y = Mul(a, c2)",
        # the intermediate has another reader
        "c1 = Constant<value = float {2}>()\n c2 = Constant<value = float {3}>()\n"
        " a = Mul(x, c1)\n b = Mul(a, c2)\n z = Neg(a)\n y = Add(b, z)",
        # the product overflows float32
        "c1 = Constant<value = float {1e30}>()\n c2 = Constant<value = float {1e30}>()\n"
        " a = Mul(x, c1)\n y = Mul(a, c2)",
    ],
    ids=["would-grow", "mixed-ops", "shared-intermediate", "overflow"],
)
def test_constant_chain_kept(body):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3, 4] x) => (float[3, 4] y) {{
          {body}
        }}
        """
    )
    before = op_types(proto)
    out, result = run_passes(proto, REASSOCIATE)
    assert not fired(result, "reassociate")
    assert op_types(out) == [t for t in before if t != "Constant"]
    assert_equivalent(proto, out)


def test_reciprocal_pair_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {
          x = Exp(xin)
          a = Reciprocal(x)
          y = Reciprocal(a)
        }
        """
    )
    out, result = run_passes(proto, REASSOCIATE)
    assert fired(result, "reassociate") == {"reciprocal-reciprocal": 1}
    assert op_types(out) == ["Exp"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, rtol=1e-6, dim_values={"N": 3})


def test_safe_preset_leaves_reassociation_alone():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] xin) => (float[N, 4] y) {
          x = Exp(xin)
          c1 = Constant<value = float {1.1}>()
          c2 = Constant<value = float {1.3}>()
          a = Mul(x, c1)
          b = Mul(a, c2)
          r = Reciprocal(b)
          y = Reciprocal(r)
        }
        """
    )
    out, result = run_passes(proto, preset="safe")
    assert "mul-chain" not in rules_fired(result)
    assert "reciprocal-reciprocal" not in rules_fired(result)
    assert op_types(out) == ["Exp", "Mul", "Mul", "Reciprocal", "Reciprocal"]
    assert_equivalent(proto, out, dim_values={"N": 3})
    out, result = run_passes(proto, preset="default")
    assert rules_fired(result)["mul-chain"] == 1
    assert rules_fired(result)["reciprocal-reciprocal"] == 1
    assert op_types(out) == ["Exp", "Mul"]
    assert_equivalent(proto, out, rtol=1e-6, dim_values={"N": 3})


def test_transpose_pair_between_graph_input_and_output_becomes_one_node():
    # cancelling would make the graph input the graph output; one identity-perm node remains
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[2, 3, 4] y) {
          t = Transpose<perm = [2, 0, 1]>(x)
          y = Transpose<perm = [1, 2, 0]>(t)
        }
        """
    )
    out, _ = run_passes(proto, ["algebraic", "identity", "dead-code"])
    assert op_types(out) == ["Transpose"]
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("perm", "shape", "fires"),
    [
        ([0, 3, 1, 2], "[2, 1, 1, 4]", True),  # only size-1 dims move
        ([0, 3, 1, 2], "[2, 3, 1, 4]", False),  # 3 and 4 change order
        ([0, 2, 1, 3], "[2, N, 1, 4]", True),  # a symbolic dim keeps its place
        ([0, 2, 1, 3], "[2, N, M, 4]", False),  # two symbolic dims swap
    ],
)
def test_a_reshape_reads_through_a_transpose_only_when_the_element_order_is_kept(
    perm, shape, fires
):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float{shape} x) => (float[2, K] y) <int64[2] s = {{2, -1}}> {{
          t = Transpose<perm = {perm}>(x)
          y = Reshape(t, s)
        }}
        """
    )
    out, _ = run_passes(proto, passes=["algebraic"])
    assert ("Transpose" not in op_types(out)) == fires
    dims = {"N": 3, "M": 5}
    feed = (
        np.random.default_rng(0)
        .standard_normal([dims.get(d.strip()) or int(d) for d in shape.strip("[]").split(",")])
        .astype(np.float32)
    )
    assert_equivalent(proto, out, inputs=[{"x": feed}])


def test_a_zero_bias_goes_where_only_the_last_dim_is_known():
    """x's rank is unknown (a computed Reshape), but a MatMul by a [4, 8] weight ends in 8: a
    zero bias of 8 and a weight of ones of 8 keep the shape, so both go; a bias of 1 element
    goes too."""
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x, int64[P] s) => (float[A, 8] y, float[B, 8] z)
          <float[4, 8] w = {1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8,
                            1, 2, 3, 4, 5, 6, 7, 8},
           float[8] zeros = {0, 0, 0, 0, 0, 0, 0, 0}, float[8] ones = {1, 1, 1, 1, 1, 1, 1, 1},
           float[1] zero1 = {0}> {
          r = Reshape(x, s)
          m = MatMul(r, w)
          a = Add(m, zeros)
          b = Relu(a)
          c = Mul(b, ones)
          y = Add(c, zero1)
          z = Relu(y)
        }
        """
    )
    out, _ = run_passes(proto, passes=["algebraic"])
    assert op_types(out) == ["Reshape", "MatMul", "Relu", "Relu"]
    feeds = [{"x": np.ones((3, 4), np.float32), "s": np.array([3, 4], np.int64)}]
    assert_equivalent(proto, out, inputs=feeds)


def _around_unsqueeze(p: list[int], axis: int, q: list[int]) -> onnx.ModelProto:
    shape = [2, 3, 4]
    mid = [shape[i] for i in p]
    mid.insert(axis, 1)
    out = [mid[j] for j in q]
    return parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[{", ".join(map(str, out))}] y) <int64[1] ax = {{{axis}}}> {{
            t = Transpose<perm = {p}>(x)
            a = Unsqueeze(t, ax)
            y = Transpose<perm = {q}>(a)
        }}
        """
    )


_PERMS3 = [list(p) for p in itertools.permutations(range(3))]
_PERMS4 = [list(p) for p in itertools.permutations(range(4))]


@pytest.mark.parametrize("p", _PERMS3, ids=lambda p: "p" + "".join(map(str, p)))
@pytest.mark.parametrize("axis", [0, 1, 3])
def test_transposes_around_an_unsqueeze_become_at_most_one(p, axis):
    """Every outer permutation: the result is the Unsqueeze of x, with one Transpose after it
    where the two do not cancel, and computes the same."""
    for q in _PERMS4[::5]:
        proto = _around_unsqueeze(p, axis, q)
        out, result = run_passes(proto, ["algebraic"])
        assert rules_fired(result).get("transpose-unsqueeze-transpose") == 1, (p, axis, q)
        ops = op_types(out)
        assert ops in (["Unsqueeze"], ["Unsqueeze", "Transpose"]), (p, axis, q, ops)
        onnx.checker.check_model(out, full_check=True)
        assert_equivalent(proto, out)


def test_transposes_around_an_unsqueeze_read_elsewhere_stay():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3, 4] x) => (float[2, 1, 3, 4] y, float[2, 4, 3] z) <int64[1] ax = {1}> {
            z = Transpose<perm = [0, 2, 1]>(x)
            a = Unsqueeze(z, ax)
            y = Transpose<perm = [0, 1, 3, 2]>(a)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "transpose-unsqueeze-transpose" not in rules_fired(result)


def test_a_squeeze_after_a_reshape_merges_only_over_unit_entries():
    # the squeezed entry of the shape is -1 (a 1 only at run time): no single shape says it
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 4, 2] x) => (float[2, 8] y) <int64[3] s = {2, -1, 8}, int64[1] ax = {1}> {
            a = Reshape(x, s)
            y = Squeeze(a, ax)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "reshape-squeeze" not in rules_fired(result)


def test_a_copied_symbolic_dim_stays_copied():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4, 2] x) => (float[N, 8] y) <int64[2] s = {0, 8}> {
            a = Relu(x)
            y = Reshape(a, s)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "reshape-static-copy" not in rules_fired(result)


def test_slices_on_a_shared_axis_stay_two():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 8] x) => (float[2, 2] y)
          <int64[1] s1 = {1}, int64[1] e1 = {6}, int64[1] s2 = {1}, int64[1] e2 = {3}, int64[1] a = {1}> {
            t = Slice(x, s1, e1, a)
            y = Slice(t, s2, e2, a)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "slice-slice" not in rules_fired(result)


@pytest.mark.parametrize(
    ("shape", "perm", "fires"),
    [
        ("[N, 1, 2, 4]", [0, 2, 1, 3], True),  # a unit dim moves: a Reshape
        ("[N, M, 1, 4]", [0, 2, 1, 3], False),  # two symbolic dims, one of them moved
        ("[N, M, 1, 4]", [0, 1, 3, 2], True),  # both symbolic dims stay in place: copied (0)
        ("[2, 3, 4]", [1, 0, 2], False),  # reorders dims that are not 1
    ],
)
def test_a_transpose_of_unit_dims_is_a_reshape(shape, perm, fires):
    dims = [d.strip() for d in shape.strip("[]").split(",")]
    out_dims = ", ".join(dims[i] for i in perm)
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float{shape} x) => (float[{out_dims}] y) {{
            a = Relu(x)
            t = Transpose<perm = {perm}>(a)
            y = Neg(t)
        }}
        """
    )
    out, result = run_passes(proto, ["algebraic"])
    assert ("transpose-unit-reshape" in rules_fired(result)) == fires
    assert ("Transpose" in op_types(out)) != fires
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(proto, out, dim_values={"N": 2, "M": 3})


def test_the_quarters_of_a_patch_merging_read_x_directly():
    # x[:, 0::2] and x[:, 1::2], each sliced again on axis 2 twice: four two-axis Slices
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 8, 8, 3] x) => (float[N, 4, 4, 12] y)
          <int64[1] z = {0}, int64[1] o = {1}, int64[1] big = {9223372036854775807},
           int64[1] a1 = {1}, int64[1] a2 = {2}, int64[1] two = {2}> {
            r0 = Slice(x, z, big, a1, two)
            r1 = Slice(x, o, big, a1, two)
            q0 = Slice(r0, z, big, a2, two)
            q1 = Slice(r1, z, big, a2, two)
            q2 = Slice(r0, o, big, a2, two)
            q3 = Slice(r1, o, big, a2, two)
            y = Concat<axis = -1>(q0, q1, q2, q3)
        }
        """
    )
    out, result = run_passes(proto, ["algebraic", "dead-code"])
    assert rules_fired(result)["slice-slice"] == 4
    assert op_types(out) == ["Slice", "Slice", "Slice", "Slice", "Concat"]
    assert all(n.input[0] == "x" for n in out.graph.node if n.op_type == "Slice")
    assert_equivalent(proto, out, dim_values={"N": 2})


def test_a_slice_read_by_another_op_too_stays():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 8, 8] x) => (float[2, 4, 4] y, float[2, 4, 8] r)
          <int64[1] z = {0}, int64[1] big = {9223372036854775807},
           int64[1] a1 = {1}, int64[1] a2 = {2}, int64[1] two = {2}> {
            t = Slice(x, z, big, a1, two)
            y = Slice(t, z, big, a2, two)
            r = Relu(t)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "slice-slice" not in rules_fired(result)


@pytest.mark.parametrize(
    ("p2", "ops"),
    [
        ([0, 2, 3, 1], ["Reshape"]),  # the permutations cancel: one view
        ([0, 2, 1, 3], ["Reshape", "Transpose"]),  # one Transpose of the split x is left
    ],
    ids=["view", "one-transpose"],
)
def test_a_split_between_two_transposes_moves_in_front(p2, ops):
    out_shape = {"[0, 2, 3, 1]": "[1, 2, 6, 4]", "[0, 2, 1, 3]": "[1, 2, 4, 6]"}[str(p2)]
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 12, 4] x) => (float{out_shape} y) <int64[4] heads = {{1, 4, 2, 6}}> {{
            t = Transpose<perm = [0, 2, 1]>(x)
            v = Reshape(t, heads)
            y = Transpose<perm = {p2}>(v)
        }}
        """
    )
    out, result = run_passes(proto, ["algebraic", "dead-code"])
    assert rules_fired(result)["transpose-split-transpose"] == 1
    assert op_types(out) == ops
    assert_equivalent(proto, out)


def test_a_reshape_that_merges_axes_between_transposes_stays():
    # [1, 4, 6] -> [1, 24]: a merge, which the transposes do not commute with
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 6, 4] x) => (float[24, 1] y) <int64[2] s = {1, 24}> {
            t = Transpose<perm = [0, 2, 1]>(x)
            v = Reshape(t, s)
            y = Transpose<perm = [1, 0]>(v)
        }
        """
    )
    _out, result = run_passes(proto, ["algebraic"])
    assert "transpose-split-transpose" not in rules_fired(result)


@pytest.mark.parametrize(
    ("y", "z", "groups"),
    [
        ([6, 4], [2, 3, 4], [[0, 1], [2]]),
        ([6, 4], [4, 6], None),
        ([1, 6], [6], [[], [0]]),
        ([6], [1, 6, 1], [[0, 1, 2]]),
        ([2, 3], [2, 1, 3], [[0], [1, 2]]),
    ],
)
def test_split_groups(y, z, groups):
    from graphtrim.graph.passes._algebra_transpose import _split_groups

    assert _split_groups(y, z) == groups


def test_unsqueezes_with_attribute_axes_merge_too():
    # opset 11: the axes are attributes (TorchScript's older exports of attention masks)
    proto = parse(
        """
        <ir_version: 7, opset_import: ["" : 11]>
        g (int64[S] r) => (int64[1, S, 1, 1] y) {
            a = Unsqueeze<axes = [0]>(r)
            b = Unsqueeze<axes = [2]>(a)
            y = Unsqueeze<axes = [3]>(b)
        }
        """
    )
    out, result = run_passes(proto, ["algebraic", "dead-code"])
    assert rules_fired(result)["unsqueeze-unsqueeze"] == 2
    assert op_types(out) == ["Unsqueeze"]
    assert list(out.graph.node[0].attribute[0].ints) == [0, 2, 3]
    assert_equivalent(proto, out, dim_values={"S": 5})


GATHERED_MASK = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[K, 1] table, int64[B, 1, 1, S] idx, float[A, C] other) => (float[B, 1, 1, S] y)
  <int64[1] flat = {-1}> {
  picked = Gather(table, idx)
  r = Reshape(picked, flat)
  s = Shape(TARGET)
  y = Reshape(r, s)
}
"""


def test_a_flattened_gather_put_back_into_its_indices_shape_is_one_reshape():
    """A mask gathered from a flat table, flattened and reshaped to the indices' shape (BERT's
    TorchScript export): ``Reshape(Reshape(x, [-1]), Shape(idx))`` reads x itself, since each
    entry that may be 0 at run time copies x's very dim (x is ``[B, 1, 1, S, 1]``)."""
    proto = parse(GATHERED_MASK.replace("TARGET", "idx"))
    out, result = run_passes(proto, [*ALGEBRAIC, "dead-code"])
    assert fired(result)["reshape-reshape"] == 1
    assert op_types(out).count("Reshape") == 1
    rng = np.random.default_rng(0)
    for b, s in ((2, 5), (1, 1), (0, 3)):  # an empty batch too: the copied dim is 0 both ways
        feeds = {
            "table": rng.standard_normal((7, 1)).astype(np.float32),
            "idx": rng.integers(0, 7, (b, 1, 1, s)).astype(np.int64),
            "other": np.zeros((2, 3), np.float32),
        }
        assert_equivalent(proto, out, inputs=[feeds])
    # a shape read from a tensor nothing relates to x: a 0 there would copy another dim
    other = parse(
        GATHERED_MASK.replace("TARGET", "other").replace("float[B, 1, 1, S] y", "float[A, C] y")
    )
    _, result = run_passes(other, ALGEBRAIC)
    assert "reshape-reshape" not in fired(result)


# ---------------------------------------------------------------- unbind of a Transpose

# timm's attention, as torch exports it: qkv.reshape(B, 3, heads, d, N).transpose(0, 1)
# .transpose(-2, -1).unbind(0) (Visformer), then q @ k.transpose(-2, -1) and attn @ v
_UNBIND = """
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[{batch}, 3, 2, 4, 6] x) => (float[{batch}, 2, 6, 4] y) <{inits}> {{
        t = Transpose<perm = [1, 0, 2, 4, 3]>(x)
        q, k, v = {split}
        qs = {sq0}
        ks = {sq1}
        vs = {sq2}
        kt = Transpose<perm = [0, 1, 3, 2]>(ks)
        s = MatMul(qs, kt)
        p = Softmax<axis = -1>(s)
        y = MatMul(p, vs)
    }}
"""


def _unbind(opset: int = 17, batch: str = "2", sizes: str = "{1, 1, 1}") -> onnx.ModelProto:
    if opset < 13:
        split = "Split<axis = 0, split = [1, 1, 1]>(t)"
        sq = [f"Squeeze<axes = [0]>({v})" for v in "qkv"]
        inits = "float[1] unused = {0.0}"
    else:
        split = "Split<axis = 0>(t, sizes)" if sizes else "Split<axis = 0>(t)"
        sq = [f"Squeeze({v}, ax)" for v in "qkv"]
        inits = "int64[1] ax = {0}" + (f", int64[3] sizes = {sizes}" if sizes else "")
    return parse(
        _UNBIND.format(
            opset=opset, batch=batch, inits=inits, split=split, sq0=sq[0], sq1=sq[1], sq2=sq[2]
        )
    )


@pytest.mark.parametrize(
    ("opset", "sizes"), [(17, "{1, 1, 1}"), (17, ""), (11, None)], ids=["sizes", "equal", "attrs"]
)
def test_an_unbind_of_a_transpose_takes_each_piece_before_transposing_it(opset, sizes):
    proto = _unbind(opset=opset, sizes=sizes)
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result)["transpose-unbind"] == 1
    # k's Transpose cancels the one left after its Gather; q and v keep a rank-4 Transpose
    assert sorted(op_types(out)) == sorted(
        ["Gather"] * 3 + ["Transpose"] * 2 + ["MatMul", "Softmax", "MatMul"]
    )
    for node in out.graph.node:
        if node.op_type == "Transpose":
            assert list(node.attribute[0].ints) == [0, 1, 3, 2]
        if node.op_type == "Gather":
            assert node.input[0] == "x" and node.attribute[0].i == 1
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(proto, out)


def test_an_unbound_transpose_leaves_onnxruntime_no_rank_5_transpose(tmp_path):
    """Why the rule exists: with every dim known, onnxruntime's own transpose optimizer moves the
    rank-5 Transpose below the Split but not below the Squeezes (its cost estimate ties), and
    the Transposes left there are rank 5: slower than the input's, and no MatMul absorbs
    them. After the rule each piece's rank-4 Transpose goes into a FusedMatMul."""
    import onnxruntime as ort

    proto = _unbind(batch="1")
    out, _ = run_passes(proto, ALGEBRAIC)

    def transposes_after_onnxruntime(model: onnx.ModelProto, name: str) -> list[int]:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(tmp_path / name)
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(tmp_path / name))
        return [len(n.attribute[0].ints) for n in optimized.graph.node if n.op_type == "Transpose"]

    assert 5 in transposes_after_onnxruntime(proto, "before.onnx")
    assert transposes_after_onnxruntime(out, "after.onnx") == []


def test_an_unbind_spelled_with_slices_takes_each_piece_before_transposing_it():
    # torch's dynamo exporter: qkv[0], qkv[1], qkv[2] as one-element Slices, then Squeezes
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2, 3, 2, 4, 6] x) => (float[2, 2, 6, 4] y)
          <int64[1] s0 = {0}, int64[1] s1 = {1}, int64[1] s2 = {2}, int64[1] s3 = {3},
           int64[1] ax = {0}, int64[1] one = {1}> {
            t = Transpose<perm = [1, 0, 2, 4, 3]>(x)
            q = Slice(t, s0, s1, ax, one)
            k = Slice(t, s1, s2, ax)
            v = Slice(t, s2, s3, ax)
            qs = Squeeze(q, ax)
            ks = Squeeze(k, ax)
            vs = Squeeze(v, ax)
            kt = Transpose<perm = [0, 1, 3, 2]>(ks)
            s = MatMul(qs, kt)
            y = MatMul(s, vs)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result)["transpose-unbind-slices"] == 1
    assert sorted(op_types(out)) == sorted(["Gather"] * 3 + ["Transpose"] * 2 + ["MatMul"] * 2)
    onnx.checker.check_model(out, full_check=True)
    assert_equivalent(proto, out)


@pytest.mark.parametrize(
    ("slices", "reason"),
    [
        ("q = Slice(t, s0, s2, ax)", "a Slice takes other than one element"),
        ("q = Slice(t, s0, s1, other)", "the Slices cut different axes"),
    ],
    ids=["two-elements", "other-axis"],
)
def test_sliced_pieces_that_are_no_unbind_stay(slices, reason):
    shape = "[2, 2, 4]" if "s2" in slices else "[3, 4]"
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2, 3, 4] x) => (float{shape} a, float[2, 4] b)
          <int64[1] s0 = {{0}}, int64[1] s1 = {{1}}, int64[1] s2 = {{2}}, int64[1] ax = {{0}},
           int64[1] other = {{1}}> {{
            t = Transpose<perm = [1, 0, 2]>(x)
            {slices}
            k = Slice(t, s1, s2, ax)
            a = {"Relu(q)" if "s2" in slices else "Squeeze(q, other)"}
            b = Squeeze(k, ax)
        }}
        """
    )
    algebraic = AlgebraicSimplification()
    algebraic.apply(ir.serde.deserialize_model(proto))
    assert "transpose-unbind-slices" not in algebraic.rule_counts
    declines = {why for (rule, why) in algebraic.declines if rule == "transpose-unbind-slices"}
    assert any(why.startswith(reason) for why in declines), declines


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("dynamic", "the pieces are not proved of size 1"),
        ("read", "a piece is not read by one Squeeze alone"),
        ("shared", "the Transpose's result is read elsewhere too"),
    ],
)
def test_an_unbind_that_is_not_proved_stays(case, reason):
    if case == "dynamic":
        # no split sizes and x's axis is symbolic: the pieces' size is not known to be 1
        proto = parse(
            """
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2, S, 4] x) => (float[4, 2] a, float[4, 2] b) <int64[1] ax = {0}> {
                t = Transpose<perm = [1, 2, 0]>(x)
                p, q = Split<axis = 0>(t)
                a = Squeeze(p, ax)
                b = Squeeze(q, ax)
            }
            """
        )
    else:
        extra, r = ("r = Relu(k)", "[1, 2, 4]") if case == "read" else ("r = Relu(t)", "[3, 2, 4]")
        proto = parse(
            f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2, 3, 4] x) => (float[2, 4] a, float[2, 4] b, float[2, 4] c, float{r} r)
              <int64[1] ax = {{0}}> {{
                t = Transpose<perm = [1, 0, 2]>(x)
                q, k, v = Split<axis = 0>(t)
                a = Squeeze(q, ax)
                b = Squeeze(k, ax)
                c = Squeeze(v, ax)
                {extra}
            }}
            """
        )
    algebraic = AlgebraicSimplification()
    algebraic.apply(ir.serde.deserialize_model(proto))
    assert "transpose-unbind" not in algebraic.rule_counts
    declines = {why for (rule, why) in algebraic.declines if rule == "transpose-unbind"}
    assert any(why.startswith(reason) for why in declines), declines


# ---------------------------------------------------------------- Where under a known condition

_EXPAND = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 3] x, float[1, 1, 3] cls) => (float[N, 1, 3] y)
      <int64[2] m = {-1, -1}, int64 neg = {-1}, int64[3] ones = {1, 1, 1}, int64[1] ax = {0},
       int64 zero = {0}> {
        sh = Shape(x)
        b = Gather<axis = 0>(sh, zero)
        bu = Unsqueeze(b, ax)
        s = Concat<axis = 0>(bu, m)
        e = Equal(s, neg)
        w = Where(e, ones, s)
        y = Expand(cls, w)
    }
"""


def test_torchscripts_expand_shape_under_a_known_condition_becomes_a_concat():
    # `cls.expand(B, -1, -1)` as TorchScript writes it: Equal(s, -1) is known (a dim is never
    # -1), and the Where picks B from s and 1 for each -1
    proto = parse(_EXPAND)
    out, result = run_passes(proto)
    assert rules_fired(result)["where-constant-select"] == 1
    assert "Where" not in op_types(out) and "Equal" not in op_types(out)
    assert op_types(out).count("Concat") == 1
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_a_where_that_picks_one_whole_side_is_that_side():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 3] x) => (float[N, 3] y) <bool[2] c = {0, 0}, int64[2] ones = {1, 1}> {
            s = Shape(x)
            w = Where(c, ones, s)
            z = ConstantOfShape<value = float[1] {0.5}>(w)
            y = Add(x, z)
        }
        """
    )
    out, result = run_passes(proto, ALGEBRAIC)
    assert fired(result)["where-constant-select"] == 1
    assert "Where" not in op_types(out)
    assert_equivalent(proto, out, dim_values={"N": 2})


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("split", "a computed piece is not picked whole and in order"),
        ("shared", "no Concat of a side goes dead"),
        ("computed", "the condition is not a constant boolean vector"),
    ],
)
def test_a_where_that_saves_no_node_or_splits_a_piece_stays(case, reason):
    cond = {"split": "{0, 1, 1}", "shared": "{0, 1, 1}", "computed": "{0, 0, 0}"}[case]
    # "split": the two dims read together, then only the first taken; "shared": s is read
    # again, so a new Concat would replace the Where alone
    piece, rest = ("Shape<end = 2>(x)", "one") if case == "split" else ("Shape<end = 1>(x)", "m")
    proto = onnx.shape_inference.infer_shapes(
        parse(
            f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[N, 3, 5] x, bool[3] k) => (int64[3] y, int64[3] z)
              <int64[2] m = {{-1, -1}}, int64[1] one = {{-1}}, int64[3] ones = {{1, 1, 1}},
               bool[3] c = {cond}> {{
                p = {piece}
                s = Concat<axis = 0>(p, {rest})
                y = Where({"k" if case == "computed" else "c"}, ones, s)
                z = {"Neg(s)" if case == "shared" else "Neg(ones)"}
            }}
            """
        )
    )
    algebraic = AlgebraicSimplification()
    algebraic.apply(ir.serde.deserialize_model(proto))
    assert "where-constant-select" not in algebraic.rule_counts
    declines = {why for (rule, why) in algebraic.declines if rule == "where-constant-select"}
    assert any(why.startswith(reason) for why in declines), declines
