"""Examples of the rules of pass ``qdq``."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.optimizer_core.graph.rule_examples import Example
from tests.optimizer_core.graph.test_qdq import _const, _dq_q_model, _model, _q_dq_model, _vi


def _constant_weight_transposed() -> onnx.ModelProto:
    """x @ Transpose(DQ(w)) with an int8 weight ``w``: the Transpose sinks below the DQ."""
    w = np.random.default_rng(0).integers(-127, 128, (5, 8)).astype(np.int8)
    return _model(
        [
            helper.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"]),
            helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "wt"], ["y"]),
        ],
        [_vi("x", TensorProto.FLOAT, [2, 8])],
        [_vi("y", TensorProto.FLOAT, [2, 5])],
        [
            numpy_helper.from_array(w, "w"),
            _const("ws", 0.003, TensorProto.FLOAT),
            _const("wzp", 0, TensorProto.INT8),
        ],
    )


# Q -> DQ rounds to the grid of scale 0.05: at most half a step apart from the unrounded input
_LOSSY = Example(model=_q_dq_model, options={"allow_lossy": True}, atol=0.05 / 2 + 1e-6)

EXAMPLES = {
    ("qdq", "dq-q"): Example(model=_dq_q_model),
    ("qdq", "q-dq-lossy"): _LOSSY,
    ("qdq", "dq-sink"): Example(model=_constant_weight_transposed),
}
