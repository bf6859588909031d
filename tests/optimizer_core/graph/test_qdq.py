"""QDQ cleanup: each rule fires where it is exact (verified in onnxruntime), and only there."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphtrim.graph.framework import OptimizeOptions
from graphtrim.graph.presets import PRESETS
from tests.helpers import assert_equivalent, op_types, rules_fired, run_passes

# qdq-move: every rule (``qdq`` is the same pass without dq-sink and q-hoist)
PASSES = ["qdq-move", "dead-code"]
RNG = np.random.default_rng(0)

NP = {
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
}


def _const(name: str, value, dtype) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=NP[dtype]), name)


def _vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "qdq", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _all_values(dtype: int, shape=None) -> np.ndarray:
    """Every value of an integer type (as a flat tensor, or cycled into ``shape``)."""
    info = np.iinfo(NP[dtype])
    values = np.arange(info.min, info.max + 1, dtype=np.int64).astype(NP[dtype])
    if shape is None:
        return values
    return np.resize(values, shape)


def _count(proto: onnx.ModelProto, op: str) -> int:
    return op_types(proto).count(op)


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# ---------------------------------------------------------------- dq-q


def _dq_q_model(
    qtype: int = TensorProto.INT8,
    *,
    scale=0.0123,
    zp=3,
    q_scale=None,
    q_zp=None,
    q_zp_type=None,
    axis: int | None = None,
    q_axis: int | None = None,
    ftype: int = TensorProto.FLOAT,
    shape=(256,),
    dq_reader: bool = False,
) -> onnx.ModelProto:
    """xq -> DQ(s, zp) -> Q(s2, zp2) -> Cast(int32) -> y (and DQ -> Relu -> z)."""
    q_scale = scale if q_scale is None else q_scale
    q_zp = zp if q_zp is None else q_zp
    inits = [
        _const("s", scale, ftype),
        _const("zp", zp, qtype),
        _const("s2", q_scale, ftype),
        _const("zp2", q_zp, q_zp_type or qtype),
    ]
    dq_attrs = {} if axis is None else {"axis": axis}
    q_attrs = dq_attrs if q_axis is None else {"axis": q_axis}
    nodes = [
        helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["d"], **dq_attrs),
        helper.make_node("QuantizeLinear", ["d", "s2", "zp2"], ["q"], **q_attrs),
        helper.make_node("Cast", ["q"], ["y"], to=TensorProto.INT32),
    ]
    outputs = [_vi("y", TensorProto.INT32, list(shape))]
    if dq_reader:
        nodes.append(helper.make_node("Relu", ["d"], ["z"]))
        outputs.append(_vi("z", ftype, list(shape)))
    return _model(nodes, [_vi("xq", qtype, list(shape))], outputs, inits)


@pytest.mark.parametrize(
    ("qtype", "zp"),
    [
        (TensorProto.INT8, 3),
        (TensorProto.UINT8, 128),
        (TensorProto.INT16, -7),
        (TensorProto.UINT16, 30000),
    ],
    ids=["int8", "uint8", "int16", "uint16"],
)
@pytest.mark.parametrize("scale", [0.0123, 1e-30, 3.7e3], ids=["typical", "tiny", "large"])
def test_dq_q_round_trip_is_removed(qtype, zp, scale):
    values = _all_values(qtype)
    proto = _dq_q_model(qtype, scale=scale, zp=zp, shape=values.shape)
    out, result = run_passes(proto, PASSES)
    assert op_types(out) == ["Cast"]
    assert rules_fired(result) == {"dq-q": 1}
    # every representable value goes through unchanged
    assert_equivalent(proto, out, inputs=[{"xq": values}])


def test_dq_q_per_axis_is_removed():
    scale = RNG.uniform(0.001, 0.1, 4).astype(np.float32)
    zp = np.array([0, -3, 5, 127], dtype=np.int8)
    proto = _dq_q_model(scale=scale, zp=zp, axis=0, shape=(4, 256))
    out, result = run_passes(proto, PASSES)
    assert op_types(out) == ["Cast"]
    assert rules_fired(result) == {"dq-q": 1}
    assert_equivalent(proto, out, inputs=[{"xq": _all_values(TensorProto.INT8, (4, 256))}])


def test_dq_q_with_float16_scale_and_int8():
    proto = _dq_q_model(scale=0.0123, ftype=TensorProto.FLOAT16)
    out, result = run_passes(proto, PASSES)
    assert op_types(out) == ["Cast"]
    assert rules_fired(result) == {"dq-q": 1}
    assert_equivalent(proto, out, inputs=[{"xq": _all_values(TensorProto.INT8)}])


def test_dq_q_keeps_the_dq_for_its_other_readers():
    proto = _dq_q_model(dq_reader=True)
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"dq-q": 1}
    assert sorted(op_types(out)) == ["Cast", "DequantizeLinear", "Relu"]
    assert_equivalent(proto, out, inputs=[{"xq": _all_values(TensorProto.INT8)}])


@pytest.mark.parametrize(
    "kw",
    [
        {"q_scale": 0.0124},
        {"q_zp": 4},
        # same zero value, different quantized type: Q's output is uint8, not x's int8
        {"zp": 0, "q_zp": 0, "q_zp_type": TensorProto.UINT8},
        {"scale": [0.01, 0.02], "zp": [0, 0], "axis": 0, "q_axis": 1, "shape": (2, 2)},
        # float16 cannot carry 16-bit integers through the round trip exactly
        {"qtype": TensorProto.INT16, "zp": 0, "ftype": TensorProto.FLOAT16},
        # k * s would be subnormal: precision is lost
        {"scale": 1e-40},
        # 255 * s overflows float32
        {"scale": 3e37},
    ],
    ids=[
        "scale-differs",
        "zero-point-differs",
        "zero-point-type-differs",
        "axis-differs",
        "float16-scale-int16",
        "subnormal-scale",
        "overflowing-scale",
    ],
)
def test_dq_q_not_removed(kw):
    proto = _dq_q_model(**kw)
    out, result = run_passes(proto, PASSES)
    assert "dq-q" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


# ---------------------------------------------------------------- dq-sink and q-hoist


MOVES = {
    "Transpose": (
        [
            helper.make_node(
                "Transpose",
                [
                    "d",
                ],
                ["m"],
                perm=[2, 0, 1],
            )
        ],
        [],
        [4, 2, 3],
    ),
    "Reshape": (
        [helper.make_node("Reshape", ["d", "shape"], ["m"])],
        [numpy_helper.from_array(np.array([6, -1], dtype=np.int64), "shape")],
        [6, 4],
    ),
    "Flatten": ([helper.make_node("Flatten", ["d"], ["m"], axis=2)], [], [6, 4]),
    "Unsqueeze": (
        [helper.make_node("Unsqueeze", ["d", "axes"], ["m"])],
        [numpy_helper.from_array(np.array([0, -1], dtype=np.int64), "axes")],
        [1, 2, 3, 4, 1],
    ),
    "Squeeze": (
        [helper.make_node("Squeeze", ["d", "axes"], ["m"])],
        [numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
        None,  # the input gets a unit dim for this one
    ),
}


def _move(op: str, src: str, dst: str):
    nodes, inits, out_shape = MOVES[op]
    node = onnx.NodeProto()
    node.CopyFrom(nodes[0])
    node.input[0] = src
    node.output[0] = dst
    return node, list(inits), out_shape


def _in_shape(op: str) -> list[int]:
    return [2, 1, 4] if op == "Squeeze" else [2, 3, 4]


@pytest.mark.parametrize("op", list(MOVES))
def test_dq_sinks_below_data_movement(op):
    """xq -> DQ -> M -> Relu -> y becomes xq -> M -> DQ -> Relu -> y."""
    move, inits, out_shape = _move(op, "d", "m")
    out_shape = out_shape or [2, 4]
    proto = _model(
        [
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["d"]),
            move,
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        [_vi("xq", TensorProto.INT8, _in_shape(op))],
        [_vi("y", TensorProto.FLOAT, out_shape)],
        [_const("s", 0.05, TensorProto.FLOAT), _const("zp", -2, TensorProto.INT8), *inits],
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"dq-sink": 1}
    assert op_types(out) == [op, "DequantizeLinear", "Relu"]
    feeds = {"xq": _all_values(TensorProto.INT8, _in_shape(op))}
    assert_equivalent(proto, out, inputs=[feeds])
    inferred = onnx.shape_inference.infer_shapes(out, strict_mode=True)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    assert types[out.graph.node[0].output[0]] == TensorProto.INT8
    assert types[out.graph.node[1].output[0]] == TensorProto.FLOAT


def test_dq_sink_into_a_graph_output():
    proto = _model(
        [
            helper.make_node("DequantizeLinear", ["xq", "s"], ["d"]),
            helper.make_node("Transpose", ["d"], ["y"], perm=[1, 0]),
        ],
        [_vi("xq", TensorProto.UINT8, [3, 5])],
        [_vi("y", TensorProto.FLOAT, [5, 3])],
        [_const("s", 0.5, TensorProto.FLOAT)],
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"dq-sink": 1}
    assert op_types(out) == ["Transpose", "DequantizeLinear"]
    assert out.graph.output[0].name == "y"
    assert_equivalent(proto, out, inputs=[{"xq": _all_values(TensorProto.UINT8, (3, 5))}])


def _per_axis_dq_transpose() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["d"], axis=0),
            helper.make_node("Transpose", ["d"], ["m"], perm=[1, 0]),
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        [_vi("xq", TensorProto.INT8, [3, 5])],
        [_vi("y", TensorProto.FLOAT, [5, 3])],
        [
            _const("s", [0.1, 0.2, 0.3], TensorProto.FLOAT),
            _const("zp", [0, 1, 2], TensorProto.INT8),
        ],
    )


def test_per_axis_dq_does_not_sink():
    proto = _per_axis_dq_transpose()
    out, result = run_passes(proto, PASSES)
    assert "dq-sink" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


def test_dq_with_other_readers_does_not_sink():
    proto = _model(
        [
            helper.make_node("DequantizeLinear", ["xq", "s"], ["d"]),
            helper.make_node("Transpose", ["d"], ["m"], perm=[1, 0]),
            helper.make_node("Relu", ["m"], ["y"]),
            helper.make_node("Neg", ["d"], ["z"]),
        ],
        [_vi("xq", TensorProto.INT8, [3, 5])],
        [_vi("y", TensorProto.FLOAT, [5, 3]), _vi("z", TensorProto.FLOAT, [3, 5])],
        [_const("s", 0.5, TensorProto.FLOAT)],
    )
    out, result = run_passes(proto, PASSES)
    assert "dq-sink" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


@pytest.mark.parametrize("op", list(MOVES))
def test_q_hoists_above_data_movement(op):
    """x -> M -> Q -> DQ -> y becomes x -> Q -> M -> DQ -> y."""
    move, inits, out_shape = _move(op, "x", "m")
    out_shape = out_shape or [2, 4]
    proto = _model(
        [
            move,
            helper.make_node("QuantizeLinear", ["m", "s", "zp"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, _in_shape(op))],
        [_vi("y", TensorProto.FLOAT, out_shape)],
        [_const("s", 0.02, TensorProto.FLOAT), _const("zp", 130, TensorProto.UINT8), *inits],
    )
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"q-hoist": 1}
    assert op_types(out) == ["QuantizeLinear", op, "DequantizeLinear"]
    feeds = {"x": (RNG.standard_normal(_in_shape(op)) * 2).astype(np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def test_per_axis_q_does_not_hoist():
    proto = _model(
        [
            helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]),
            helper.make_node("QuantizeLinear", ["m", "s", "zp"], ["q"], axis=1),
            helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1),
        ],
        [_vi("x", TensorProto.FLOAT, [3, 5])],
        [_vi("y", TensorProto.FLOAT, [5, 3])],
        [
            _const("s", [0.1, 0.2, 0.3], TensorProto.FLOAT),
            _const("zp", [0, 1, 2], TensorProto.INT8),
        ],
    )
    out, result = run_passes(proto, PASSES)
    assert "q-hoist" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


def _dq_move_q_chain(*, dq_reader: bool) -> onnx.ModelProto:
    """x -> Q -> DQ -> Reshape -> Q -> DQ -> Relu -> y (and the first DQ -> Neg -> z)."""
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q1"]),
        helper.make_node("DequantizeLinear", ["q1", "s", "zp"], ["d1"]),
        helper.make_node("Reshape", ["d1", "shape"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s_copy", "zp_copy"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s_copy", "zp_copy"], ["d2"]),
        helper.make_node("Relu", ["d2"], ["y"]),
    ]
    outputs = [_vi("y", TensorProto.FLOAT, [4, 6])]
    if dq_reader:
        nodes.append(helper.make_node("Neg", ["d1"], ["z"]))
        outputs.append(_vi("z", TensorProto.FLOAT, [2, 3, 4]))
    return _model(
        nodes,
        [_vi("x", TensorProto.FLOAT, [2, 3, 4])],
        outputs,
        [
            # equal values under different names, as quantizers write them
            _const("s", 0.03, TensorProto.FLOAT),
            _const("zp", 5, TensorProto.INT8),
            _const("s_copy", 0.03, TensorProto.FLOAT),
            _const("zp_copy", 5, TensorProto.INT8),
            numpy_helper.from_array(np.array([4, 6], dtype=np.int64), "shape"),
        ],
    )


def test_dq_move_q_chain_collapses():
    proto = _dq_move_q_chain(dq_reader=False)
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"dq-sink": 1, "dq-q": 1}
    assert op_types(out) == ["QuantizeLinear", "Reshape", "DequantizeLinear", "Relu"]
    feeds = {"x": (RNG.standard_normal((2, 3, 4)) * 3).astype(np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


def test_dq_move_q_chain_collapses_when_the_dq_has_other_readers():
    proto = _dq_move_q_chain(dq_reader=True)
    out, result = run_passes(proto, PASSES)
    assert rules_fired(result) == {"q-hoist": 1, "dq-q": 1}
    assert _count(out, "QuantizeLinear") == 1
    assert _count(out, "DequantizeLinear") == 2  # one for Neg, one for Relu
    feeds = {"x": (RNG.standard_normal((2, 3, 4)) * 3).astype(np.float32)}
    assert_equivalent(proto, out, inputs=[feeds])


# ---------------------------------------------------------------- q-dq-lossy


def _q_dq_model(*, dq_scale: float = 0.05) -> onnx.ModelProto:
    """x -> Relu -> Q -> DQ -> Neg -> y."""
    return _model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("QuantizeLinear", ["r", "s", "zp"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s2", "zp"], ["d"]),
            helper.make_node("Neg", ["d"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [4, 16])],
        [_vi("y", TensorProto.FLOAT, [4, 16])],
        [
            _const("s", 0.05, TensorProto.FLOAT),
            _const("s2", dq_scale, TensorProto.FLOAT),
            _const("zp", 0, TensorProto.INT8),
        ],
    )


def test_q_dq_kept_without_allow_lossy():
    proto = _q_dq_model()
    out, result = run_passes(proto, PASSES)
    assert "q-dq-lossy" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


def test_q_dq_removed_with_allow_lossy():
    proto = _q_dq_model()
    out, result = run_passes(proto, PASSES, options=OptimizeOptions(allow_lossy=True))
    assert rules_fired(result) == {"q-dq-lossy": 1}
    assert op_types(out) == ["Relu", "Neg"]
    onnx.checker.check_model(out, full_check=True)
    # inside the representable range [0, 127 * 0.05]: the difference is the rounding only
    x = RNG.uniform(-6.0, 6.0, (4, 16)).astype(np.float32)
    (before,) = _run(proto, {"x": x})
    (after,) = _run(out, {"x": x})
    diff = float(np.max(np.abs(before.astype(np.float64) - after.astype(np.float64))))
    assert 0.0 < diff <= 0.05 / 2 + 1e-6


def test_q_dq_with_different_scales_kept_even_when_lossy():
    proto = _q_dq_model(dq_scale=0.1)
    out, result = run_passes(proto, PASSES, options=OptimizeOptions(allow_lossy=True))
    assert "q-dq-lossy" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


# ---------------------------------------------------------------- quantized weights


def test_constant_dq_weight_stays_quantized():
    """The default preset keeps int8 weights under DequantizeLinear (Conv per channel, MatMul
    per tensor through a Transpose that is moved onto the int8 weight and folded there)."""
    w = RNG.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    w2 = RNG.integers(-127, 128, (5, 4 * 8 * 8)).astype(np.int8)
    proto = _model(
        [
            helper.make_node("QuantizeLinear", ["x", "xs", "xzp"], ["xq"]),
            helper.make_node("DequantizeLinear", ["xq", "xs", "xzp"], ["xd"]),
            helper.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"], axis=0),
            helper.make_node("Conv", ["xd", "wd", "b"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("Flatten", ["r"], ["f"]),
            helper.make_node("DequantizeLinear", ["w2", "w2s", "w2zp"], ["w2d"]),
            helper.make_node("Transpose", ["w2d"], ["w2t"], perm=[1, 0]),
            helper.make_node("MatMul", ["f", "w2t"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [_vi("y", TensorProto.FLOAT, [1, 5])],
        [
            _const("xs", 0.02, TensorProto.FLOAT),
            _const("xzp", 0, TensorProto.INT8),
            numpy_helper.from_array(w, "w"),
            _const("ws", RNG.uniform(0.001, 0.01, 4), TensorProto.FLOAT),
            _const("wzp", [0, 0, 0, 0], TensorProto.INT8),
            _const("b", RNG.standard_normal(4), TensorProto.FLOAT),
            numpy_helper.from_array(w2, "w2"),
            _const("w2s", 0.003, TensorProto.FLOAT),
            _const("w2zp", 0, TensorProto.INT8),
        ],
    )
    out, result = run_passes(proto)
    assert "dq-sink" in rules_fired(result)
    inits = {i.name: i for i in out.graph.initializer}
    dq_inputs = [n.input[0] for n in out.graph.node if n.op_type == "DequantizeLinear"]
    assert "w" in dq_inputs and inits["w"].data_type == TensorProto.INT8
    # the transposed MatMul weight is an int8 initializer read by a DequantizeLinear
    quantized = [n for n in dq_inputs if n in inits and inits[n].data_type == TensorProto.INT8]
    assert len(quantized) == 2
    assert any(list(inits[n].dims) == [4 * 8 * 8, 5] for n in quantized)
    assert not any(
        i.data_type == TensorProto.FLOAT and len(i.dims) > 1 for i in out.graph.initializer
    )
    assert_equivalent(proto, out)


# ---------------------------------------------------------------- a quantizer's output


def test_quantized_model_end_to_end(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.feeds = iter(
                [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
            )

        def get_next(self):
            return next(self.feeds, None)

    float_model = _model(
        [
            helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("Reshape", ["r", "shape"], ["f"]),
            helper.make_node("MatMul", ["f", "W2"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [_vi("y", TensorProto.FLOAT, [1, 5])],
        [
            _const("W", RNG.standard_normal((4, 3, 3, 3)), TensorProto.FLOAT),
            _const("B", RNG.standard_normal(4), TensorProto.FLOAT),
            numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "shape"),
            _const("W2", RNG.standard_normal((4 * 8 * 8, 5)), TensorProto.FLOAT),
        ],
        opset=17,
    )
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(float_model, src)
    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ)
    proto = onnx.load(str(dst))
    producers = {o: n for n in proto.graph.node for o in n.output}

    def dq_reshape_q(n: onnx.NodeProto) -> bool:
        if n.op_type != "QuantizeLinear" or producers.get(n.input[0]) is None:
            return False
        reshape = producers[n.input[0]]
        return reshape.op_type == "Reshape" and (
            producers.get(reshape.input[0]) is not None
            and producers[reshape.input[0]].op_type == "DequantizeLinear"
        )

    chains = [n for n in proto.graph.node if dq_reshape_q(n)]
    assert chains, "the quantizer wraps the Reshape in DQ -> Reshape -> Q"
    out, result = run_passes(proto, PASSES)
    fired = rules_fired(result)
    assert fired.get("dq-q", 0) >= len(chains)
    assert fired.keys() <= {"dq-sink", "q-hoist", "dq-q"}
    out_producers = {o: n for n in out.graph.node for o in n.output}
    for n in out.graph.node:
        if n.op_type == "QuantizeLinear":
            src_node = out_producers.get(n.input[0])
            assert src_node is None or src_node.op_type not in ("DequantizeLinear", "Reshape")
    assert len(out.graph.node) < len(proto.graph.node)
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    assert_equivalent(proto, out, inputs=feeds)


# ---------------------------------------------------------------- presets


def test_qdq_runs_after_casts_and_is_safe():
    order = PRESETS["default"]
    assert order.index("qdq") == order.index("casts") + 1
    assert "qdq" in PRESETS["safe"]


def test_qdq_move_is_only_in_compact():
    assert "qdq-move" in PRESETS["compact"]
    assert "qdq-move" not in PRESETS["default"] and "qdq-move" not in PRESETS["safe"]


def test_qdq_alone_leaves_data_movement_in_float():
    proto = _dq_move_q_chain(dq_reader=False)
    out, result = run_passes(proto, ["qdq", "dead-code"])
    assert "dq-sink" not in rules_fired(result) and "q-hoist" not in rules_fired(result)
    assert op_types(out) == op_types(proto)


def _ort_optimized_ops(proto: onnx.ModelProto, folder) -> list[str]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(folder / "ort.onnx")
    ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return op_types(onnx.load(so.optimized_model_filepath))


def test_default_preset_keeps_onnxruntime_qdq_fusions(tmp_path):
    """onnxruntime fuses DQ -> op -> Q units itself; moving a Reshape between a MaxPool's Q and
    a Gemm's DQ (qdq-move) hides both from it, so only the compact preset does that."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.feeds = iter(
                [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
            )

        def get_next(self):
            return next(self.feeds, None)

    float_model = _model(
        [
            helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"]),
            helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Reshape", ["p", "shape"], ["f"]),
            helper.make_node("Gemm", ["f", "W2", "B2"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [_vi("y", TensorProto.FLOAT, [1, 5])],
        [
            _const("W", RNG.standard_normal((8, 3, 3, 3)), TensorProto.FLOAT),
            _const("B", RNG.standard_normal(8), TensorProto.FLOAT),
            numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "shape"),
            _const("W2", RNG.standard_normal((8 * 4 * 4, 5)), TensorProto.FLOAT),
            _const("B2", RNG.standard_normal(5), TensorProto.FLOAT),
        ],
        opset=17,
    )
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(float_model, src)
    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ)
    proto = onnx.load(str(dst))
    fused = _ort_optimized_ops(proto, tmp_path)
    assert "QGemm" in fused and "Gemm" not in fused, fused

    for preset in ("default", "safe"):
        out, _ = run_passes(proto, preset=preset)
        assert _ort_optimized_ops(out, tmp_path) == fused, preset
    out, result = run_passes(proto, preset="compact")
    assert "q-hoist" in rules_fired(result) or "dq-sink" in rules_fired(result)
    assert "Gemm" in _ort_optimized_ops(out, tmp_path)
