"""Examples of the ``space-to-depth`` and ``fuse-channel-gather`` rules: YOLOv5's focus block,
four strided slices of the image concatenated on the channels, then a Conv."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh

from tests.optimizer_core.graph.rule_examples import Example

FLOAT = onnx.TensorProto.FLOAT
END = 2**63 - 1


def focus(order: tuple[tuple[int, int], ...], conv: bool, chained: bool = True) -> onnx.ModelProto:
    """x[N, 3, 8, 8] -> Concat(x[..., a::2, b::2] for (a, b) in order) [-> Conv 12 -> 4]."""
    inits = [
        onh.from_array(np.array([v], np.int64), n)
        for n, v in (("zero", 0), ("one", 1), ("end", END), ("h", 2), ("w", 3), ("two", 2))
    ]
    inits.append(onh.from_array(np.array([0, 1], np.int64), "z2"))
    inits.append(onh.from_array(np.array([1, 1], np.int64), "o2"))
    inits.append(onh.from_array(np.array([END, END], np.int64), "e2"))
    inits.append(onh.from_array(np.array([2, 3], np.int64), "hw"))
    inits.append(onh.from_array(np.array([2, 2], np.int64), "t2"))
    nodes, parts = [], []
    start = {0: "zero", 1: "one"}
    for a, b in order:
        part = f"p{a}{b}"
        if chained:  # torch's exporters: one Slice per axis
            nodes.append(oh.make_node("Slice", ["x", start[a], "end", "h", "two"], [f"r{a}{b}"]))
            nodes.append(oh.make_node("Slice", [f"r{a}{b}", start[b], "end", "w", "two"], [part]))
        else:  # one Slice over both axes
            starts = onh.from_array(np.array([a, b], np.int64), f"s{a}{b}")
            inits.append(starts)
            nodes.append(oh.make_node("Slice", ["x", f"s{a}{b}", "e2", "hw", "t2"], [part]))
        parts.append(part)
    out = "cat" if conv else "y"
    nodes.append(oh.make_node("Concat", parts, [out], axis=1))
    if conv:
        w = np.random.default_rng(0).standard_normal((4, 12, 3, 3)).astype(np.float32)
        inits.append(onh.from_array(w, "W"))
        nodes.append(oh.make_node("Conv", ["cat", "W"], ["y"], pads=[1, 1, 1, 1]))
    graph = oh.make_graph(
        nodes,
        "focus",
        [oh.make_tensor_value_info("x", FLOAT, ["N", 3, 8, 8])],
        [oh.make_tensor_value_info("y", FLOAT, None)],
        inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


YOLO_ORDER = ((0, 0), (1, 0), (0, 1), (1, 1))

EXAMPLES: dict[tuple[str, str], Example] = {
    ("space-to-depth", "focus-space-to-depth"): Example(model=lambda: focus(YOLO_ORDER, False)),
    ("fuse-channel-gather", "gather-conv"): Example(
        model=lambda: focus(YOLO_ORDER, True),
        passes=["space-to-depth", "fuse-channel-gather"],
        rtol=1e-5,
        atol=1e-5,
    ),
}
