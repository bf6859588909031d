"""Examples of the rules of pass ``qdq-move``."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_qdq import _const, _dq_q_model, _model, _q_dq_model, _vi


def _activation_dq_reshaped() -> onnx.ModelProto:
    """DQ(xq) -> Reshape -> Relu: the Reshape moves onto the int8 input."""
    return _model(
        [
            helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["d"]),
            helper.make_node("Reshape", ["d", "shape"], ["m"]),
            helper.make_node("Relu", ["m"], ["y"]),
        ],
        [_vi("xq", TensorProto.INT8, [2, 3, 4])],
        [_vi("y", TensorProto.FLOAT, [6, 4])],
        [
            _const("s", 0.05, TensorProto.FLOAT),
            _const("zp", -2, TensorProto.INT8),
            numpy_helper.from_array(np.array([6, 4], dtype=np.int64), "shape"),
        ],
    )


def _q_after_transpose() -> onnx.ModelProto:
    """x -> Transpose -> Q -> DQ: the Q moves above the Transpose."""
    return _model(
        [
            helper.make_node("Transpose", ["x"], ["m"], perm=[1, 0]),
            helper.make_node("QuantizeLinear", ["m", "s", "zp"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [3, 4])],
        [_vi("y", TensorProto.FLOAT, [4, 3])],
        [_const("s", 0.02, TensorProto.FLOAT), _const("zp", 130, TensorProto.UINT8)],
    )


# Q -> DQ rounds to the grid of scale 0.05: at most half a step apart from the unrounded input
_LOSSY = Example(model=_q_dq_model, options={"allow_lossy": True}, atol=0.05 / 2 + 1e-6)

EXAMPLES = {
    ("qdq-move", "dq-q"): Example(model=_dq_q_model),
    ("qdq-move", "q-hoist"): Example(model=_q_after_transpose),
    ("qdq-move", "q-dq-lossy"): _LOSSY,
    ("qdq-move", "dq-sink"): Example(model=_activation_dq_reshaped),
}
