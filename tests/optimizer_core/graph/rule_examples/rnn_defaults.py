"""Examples of the ``rnn-defaults`` rules: a GRU and an LSTM whose zero state is built from the
batch size at run time (as the TorchScript exporter does), and zero biases and peepholes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from tests.optimizer_core.graph.rule_examples import Example

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
HIDDEN, FEATURES = 3, 4


def _recurrent(op: str, zero_bias: bool) -> onnx.ModelProto:
    gates = {"GRU": 3, "LSTM": 4, "RNN": 1}[op]
    rng = np.random.default_rng(0)

    def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
        return onh.from_array(arr.astype(arr.dtype), name)

    inits = [
        init("W", rng.standard_normal((1, gates * HIDDEN, FEATURES)).astype(np.float32)),
        init("R", rng.standard_normal((1, gates * HIDDEN, HIDDEN)).astype(np.float32)),
        init("one", np.array(1, np.int64)),
        init("ax0", np.array([0], np.int64)),
        init("lead", np.array([1], np.int64)),
        init("hid", np.array([HIDDEN], np.int64)),
        init("s0", np.array([0], np.int64)),
        init("s1", np.array([1], np.int64)),
    ]
    bias = np.zeros((1, 2 * gates * HIDDEN), np.float32)
    if not zero_bias:
        bias = rng.standard_normal(bias.shape).astype(np.float32)
    inits.append(init("B", bias))
    nodes = [
        oh.make_node("Shape", ["x"], ["shape"]),
        oh.make_node("Gather", ["shape", "one"], ["batch"]),
        oh.make_node("Unsqueeze", ["batch", "ax0"], ["batch1"]),
        oh.make_node("Concat", ["lead", "batch1", "hid"], ["state_shape"], axis=0),
        oh.make_node("ConstantOfShape", ["state_shape"], ["zeros"]),
        # one layer's slice of a multi-layer zero state
        oh.make_node("Slice", ["zeros", "s0", "s1", "s0"], ["h0"]),
    ]
    ins = ["x", "W", "R", "B", "", "h0"]
    if op == "LSTM":
        ins.append("h0")
        if zero_bias:
            inits.append(init("P", np.zeros((1, 3 * HIDDEN), np.float32)))
            ins.append("P")
    nodes.append(oh.make_node(op, ins, ["y", "y_h"], hidden_size=HIDDEN))
    graph = oh.make_graph(
        nodes,
        "recurrent",
        [oh.make_tensor_value_info("x", FLOAT, [5, "N", FEATURES])],
        [
            oh.make_tensor_value_info("y", FLOAT, None),
            oh.make_tensor_value_info("y_h", FLOAT, None),
        ],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


EXAMPLES: dict[tuple[str, str], Example] = {
    ("rnn-defaults", "zero-initial-state"): Example(model=lambda: _recurrent("GRU", False)),
    ("rnn-defaults", "zero-bias"): Example(
        model=lambda: _recurrent("LSTM", True), passes=["rnn-defaults"]
    ),
}
