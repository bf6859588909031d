"""Cast chain elimination: each rule fires, results are unchanged, the checker passes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from graphtrim.graph.passes.casts import is_exact_cast
from tests.helpers import assert_equivalent, op_types, parse, rules_fired, run_passes

D = ir.DataType
PASSES = ["casts", "dead-code"]


def _model(src: str, mid: str, dst: str, dims: str = "[N, 4]") -> str:
    return f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({src}{dims} x) => ({dst}{dims} y) {{
          a = Cast<to = {int(getattr(D, mid.upper()))}>(x)
          y = Cast<to = {int(getattr(D, dst.upper()))}>(a)
        }}
        """


def _cast_targets(proto) -> list[int]:
    return [n.attribute[0].i for n in proto.graph.node if n.op_type == "Cast"]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("src", "mid"),
    [
        ("float", "double"),
        ("float16", "float"),
        ("int8", "int32"),
        ("uint8", "int16"),
        ("int32", "int64"),
        ("uint16", "float"),
        ("bool", "float"),
        ("bool", "int8"),
    ],
    ids=lambda v: v,
)
def test_exact_round_trip_removed(src, mid):
    proto = parse(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({src}[N, 4] xin) => ({src}[N, 4] y) {{
          x = Identity(xin)
          a = Cast<to = {int(getattr(D, mid.upper()))}>(x)
          y = Cast<to = {int(getattr(D, src.upper()))}>(a)
        }}
        """
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"cast-round-trip": 1}
    assert op_types(out) == ["Identity"]
    assert [o.name for o in out.graph.output] == ["y"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_bfloat16_round_trip_removed():
    # onnxruntime takes no bfloat16 feeds: make the bfloat16 values inside the model
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          b = Cast<to = 16>(x)
          f = Cast<to = 1>(b)
          b2 = Cast<to = 16>(f)
          y = Cast<to = 1>(b2)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"cast-round-trip": 1}
    assert op_types(out) == ["Cast", "Cast"]
    assert _cast_targets(out) == [int(D.BFLOAT16), int(D.FLOAT)]
    assert list(out.graph.node[1].input) == ["b"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_round_trip_of_a_graph_input_to_the_output_kept():
    # y = Cast(Cast(x)) with x a graph input: y cannot become x under another name
    proto = parse(_model("float", "double", "float"))
    out, result = run_passes(proto, PASSES)
    assert not rules_fired(result)
    assert op_types(out) == ["Cast", "Cast"]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_round_trip_feeding_another_node_removed():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 4] y) {
          a = Cast<to = 11>(x)
          b = Cast<to = 1>(a)
          y = Neg(b)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result)["cast-round-trip"] == 1
    assert op_types(out) == ["Neg"]
    assert list(out.graph.node[0].input) == ["x"]
    # values beyond float16's range and precision survive unchanged
    feeds = [{"x": np.array([[1e30, -1e-30, 3.14159274, 65504.5]] * 2, dtype=np.float32)}]
    assert_equivalent(proto, out, inputs=feeds)


# ---------------------------------------------------------------- chains


@pytest.mark.parametrize(
    ("src", "mid", "dst"),
    [
        ("float", "double", "float16"),
        ("int8", "int32", "float"),
        ("uint8", "int32", "double"),
        ("float16", "double", "int32"),
        ("int16", "int64", "int8"),
        ("bool", "int32", "float"),
    ],
    ids=lambda v: v,
)
def test_chain_after_exact_cast_becomes_one_cast(src, mid, dst):
    proto = parse(_model(src, mid, dst))
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result)["cast-chain"] == 1
    assert op_types(out) == ["Cast"]
    (node,) = out.graph.node
    assert list(node.input) == ["x"]
    assert _cast_targets(out) == [int(getattr(D, dst.upper()))]
    assert_equivalent(proto, out, dim_values={"N": 3})


def test_chain_keeps_the_intermediate_when_it_has_other_readers():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (int8[N, 4] x) => (float[N, 4] y, int32[N, 4] z) {
          z = Cast<to = 6>(x)
          y = Cast<to = 1>(z)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"cast-chain": 1}
    assert op_types(out) == ["Cast", "Cast"]
    assert [list(n.input) for n in out.graph.node] == [["x"], ["x"]]
    assert_equivalent(proto, out, dim_values={"N": 3})


@pytest.mark.parametrize(
    ("src", "mid", "dst", "feed"),
    [
        ("float", "float16", "float", [1.0001, 70000.0, 1e-8, -3.3]),
        ("float", "bfloat16", "float", [1.0001, 3.3, -7.77, 1e-3]),
        ("int32", "int8", "int32", [127, 128, -129, 1000]),
        ("int32", "float", "int32", [16777217, 1, -16777219, 5]),
        ("int64", "double", "int64", [2**53 + 1, 1, 2, 3]),
        ("float", "int32", "float", [1.5, -2.7, 0.2, 3.0]),
        ("int32", "uint32", "int64", [-1, 2, -3, 4]),
        ("float16", "bfloat16", "float", [1.0009766, 2.0, 3.0, 4.0]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_lossy_first_cast_kept(src, mid, dst, feed):
    proto = parse(_model(src, mid, dst, dims="[4]"))
    out, result = run_passes(proto, PASSES)
    assert not rules_fired(result)
    assert op_types(out) == ["Cast", "Cast"]
    assert _cast_targets(out) == [int(getattr(D, mid.upper())), int(getattr(D, dst.upper()))]
    np_dtype = ir.DataType[src.upper()].numpy()
    assert_equivalent(proto, out, inputs=[{"x": np.array(feed).astype(np_dtype)}])


def test_non_cast_producer_left_alone():
    proto = parse(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (double[N, 4] y) {
          a = Neg(x)
          y = Cast<to = 11>(a)
        }
        """
    )
    out, result = run_passes(proto, PASSES)
    assert not rules_fired(result)
    assert op_types(out) == ["Neg", "Cast"]
    assert_equivalent(proto, out, dim_values={"N": 3})


# ---------------------------------------------------------------- is_exact_cast


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (D.FLOAT, D.FLOAT),
        (D.FLOAT, D.DOUBLE),
        (D.FLOAT16, D.FLOAT),
        (D.FLOAT16, D.DOUBLE),
        (D.BFLOAT16, D.FLOAT),
        (D.INT8, D.INT16),
        (D.INT8, D.INT64),
        (D.UINT8, D.UINT16),
        (D.UINT8, D.INT16),
        (D.UINT32, D.INT64),
        (D.INT8, D.FLOAT16),
        (D.UINT8, D.FLOAT16),
        (D.UINT8, D.BFLOAT16),
        (D.INT16, D.FLOAT),
        (D.INT32, D.DOUBLE),
        (D.UINT32, D.DOUBLE),
        (D.BOOL, D.INT8),
        (D.BOOL, D.UINT8),
        (D.BOOL, D.FLOAT16),
        (D.BOOL, D.DOUBLE),
    ],
    ids=lambda d: d.name,
)
def test_is_exact_cast_true(src, dst):
    assert is_exact_cast(src, dst)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (D.DOUBLE, D.FLOAT),
        (D.FLOAT, D.FLOAT16),
        (D.FLOAT, D.BFLOAT16),
        (D.FLOAT16, D.BFLOAT16),  # bfloat16 has fewer significand bits
        (D.BFLOAT16, D.FLOAT16),  # float16 has a smaller exponent range
        (D.INT16, D.INT8),
        (D.INT8, D.UINT8),  # negatives
        (D.INT8, D.UINT64),
        (D.UINT8, D.INT8),  # 200 does not fit
        (D.UINT32, D.INT32),
        (D.INT16, D.FLOAT16),
        (D.INT16, D.BFLOAT16),
        (D.INT32, D.FLOAT),
        (D.UINT32, D.FLOAT),
        (D.INT64, D.DOUBLE),
        (D.UINT64, D.DOUBLE),
        (D.FLOAT, D.INT64),
        (D.FLOAT16, D.INT32),
        (D.INT8, D.BOOL),
        (D.FLOAT, D.BOOL),
        (D.FLOAT, D.STRING),
        (D.STRING, D.FLOAT),
        (D.FLOAT, D.FLOAT8E4M3FN),
    ],
    ids=lambda d: d.name,
)
def test_is_exact_cast_false(src, dst):
    assert not is_exact_cast(src, dst)


_SMALL = [D.BOOL, D.INT8, D.UINT8, D.INT16, D.UINT16, D.FLOAT16, D.BFLOAT16]
_ALL = [
    *_SMALL,
    D.INT32,
    D.UINT32,
    D.INT64,
    D.UINT64,
    D.FLOAT,
    D.DOUBLE,
]


def _every_value(dtype: ir.DataType) -> np.ndarray:
    """Every finite value of a type of at most 16 bits."""
    np_dtype = dtype.numpy()
    if dtype == D.BOOL:
        return np.array([False, True])
    if np.issubdtype(np_dtype, np.integer):
        info = np.iinfo(np_dtype)
        return np.arange(int(info.min), int(info.max) + 1).astype(np_dtype)
    values = np.arange(2**16, dtype=np.uint16).view(np_dtype)
    with np.errstate(invalid="ignore"):
        return values[np.isfinite(values.astype(np.float64))]


@pytest.mark.parametrize("dst", _ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("src", _SMALL, ids=lambda d: d.name)
def test_is_exact_cast_agrees_with_numpy(src, dst):
    # exhaustive: the cast is exact iff every value of the source comes out unchanged
    values = _every_value(src)
    with np.errstate(all="ignore"):
        converted = values.astype(dst.numpy())
    unchanged = np.array_equal(converted.astype(np.float64), values.astype(np.float64))
    assert is_exact_cast(src, dst) == unchanged
