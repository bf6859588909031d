"""The numpy fast path of constant folding agrees bit for bit with onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from graphtrim.graph.passes import _numpy_eval
from graphtrim.verify import Session

CASES = [
    (
        "Unsqueeze",
        [np.arange(6, dtype=np.int64).reshape(2, 3), np.array([0, -1], dtype=np.int64)],
        {},
    ),
    ("Squeeze", [np.ones((1, 3, 1), dtype=np.float32), np.array([2], dtype=np.int64)], {}),
    ("Squeeze", [np.ones((1, 3, 1), dtype=np.float32)], {}),
    (
        "Reshape",
        [np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.array([0, -1], dtype=np.int64)],
        {},
    ),
    (
        "Gather",
        [np.arange(12, dtype=np.int64).reshape(3, 4), np.array([[-1, 0]], dtype=np.int64)],
        {"axis": 1},
    ),
    ("Concat", [np.array([1, 2], dtype=np.int64), np.array([-1], dtype=np.int64)], {"axis": 0}),
    ("Transpose", [np.arange(24, dtype=np.float32).reshape(2, 3, 4)], {"perm": [2, 0, 1]}),
    ("Cast", [np.array([-3, 300, 7], dtype=np.int64)], {"to": onnx.TensorProto.INT8}),
    ("Cast", [np.array([0, 2, -1], dtype=np.int32)], {"to": onnx.TensorProto.BOOL}),
    ("Add", [np.array([2**62, 5], dtype=np.int64), np.array([2**62, -7], dtype=np.int64)], {}),
    ("Sub", [np.array([3, 5], dtype=np.int32), np.array([[1], [9]], dtype=np.int32)], {}),
    ("Mul", [np.array([2**40, 3], dtype=np.int64), np.array([2**30, -1], dtype=np.int64)], {}),
    (
        "ConstantOfShape",
        [np.array([2, 3], dtype=np.int64)],
        {"value": helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [0.25])},
    ),
]


@pytest.mark.parametrize(
    ("op", "inputs", "attrs"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_numpy_matches_onnxruntime(op, inputs, attrs):
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [],
        [helper.make_value_info("y", onnx.TypeProto())],
        [numpy_helper.from_array(a, n) for a, n in zip(inputs, names, strict=True)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = onnx.shape_inference.infer_shapes(model)
    expected = Session(model).run({})["y"]

    ir_model = ir.serde.deserialize_model(model)
    ir_node = next(iter(ir_model.graph))
    feeds = {id(v): v.const_value.numpy() for v in ir_node.inputs if v is not None}
    (got,) = _numpy_eval.evaluate([ir_node], feeds, [ir_node.outputs[0]])
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert np.array_equal(got, expected)


def test_unsupported_op_defers_to_onnxruntime():
    graph = helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["y"])],
        "g",
        [],
        [helper.make_value_info("y", onnx.TypeProto())],
        [
            numpy_helper.from_array(np.array([-7], dtype=np.int64), "a"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "b"),
        ],
    )
    ir_model = ir.serde.deserialize_model(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    )
    node = next(iter(ir_model.graph))
    feeds = {id(v): v.const_value.numpy() for v in node.inputs if v is not None}
    # integer Div truncates toward zero in onnxruntime but floors in numpy: never done here
    assert _numpy_eval.evaluate([node], feeds, [node.outputs[0]]) is None
