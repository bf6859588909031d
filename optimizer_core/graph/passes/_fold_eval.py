"""Evaluation of the values constant folding materializes (pass ``constant-folding``): in numpy
when every op is one it computes exactly, else in one onnxruntime session."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from graphtrim.graph import _ir_utils as u
from graphtrim.graph.passes import _numpy_eval

logger = logging.getLogger("graphtrim.optimizer")

# a value to fold: the value, the nodes computing it (in graph order), the constants they read
Plan = tuple[ir.Value, list[ir.Node], list[ir.Value]]


def run_numpy(plans: Sequence[Plan]) -> list[np.ndarray | None] | None:
    """Every planned value evaluated in numpy, or ``None`` when an op is not one numpy computes
    exactly (see :mod:`graphtrim.graph.passes._numpy_eval`)."""
    nodes: dict[int, ir.Node] = {}
    feeds: dict[int, np.ndarray] = {}
    for _, closure, const_inputs in plans:
        for n in closure:
            nodes[id(n)] = n
        for c in const_inputs:
            arr = u.const_array(c)
            if arr is None:
                return None
            feeds[id(c)] = arr
    graph = plans[0][0].graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    ordered = sorted(nodes.values(), key=lambda n: order.get(id(n), 0))
    results = _numpy_eval.evaluate(ordered, feeds, [value for value, _, _ in plans])
    if results is None:
        return None
    for (value, _, _), arr in zip(plans, results, strict=True):
        if value.dtype is None or arr.dtype != value.dtype.numpy():
            return None
    logger.debug("folded %d value(s) in numpy", len(results))
    return list(results)


def run_onnxruntime(model: ir.Model, plans: Sequence[Plan]) -> list[np.ndarray | None]:
    """Every planned value evaluated in one onnxruntime session (raises when it cannot run)."""
    import onnxruntime as ort

    names: dict[int, str] = {}

    def name_of(v: ir.Value) -> str:
        if id(v) not in names:
            names[id(v)] = f"v{len(names)}"
        return names[id(v)]

    nodes: dict[int, ir.Node] = {}
    consts: dict[int, ir.Value] = {}
    for _, closure, const_inputs in plans:
        for n in closure:
            nodes[id(n)] = n
        for c in const_inputs:
            consts[id(c)] = c
    graph = plans[0][0].graph
    order = {id(n): i for i, n in enumerate(graph)} if graph is not None else {}
    node_protos: list[onnx.NodeProto] = []
    for n in sorted(nodes.values(), key=lambda n: order.get(id(n), 0)):
        proto = ir.serde.serialize_node(n)
        proto.ClearField("input")
        proto.ClearField("output")
        proto.input.extend(name_of(v) if v is not None else "" for v in n.inputs)
        proto.output.extend(name_of(v) for v in n.outputs)
        proto.name = f"n{len(node_protos)}"
        node_protos.append(proto)
    feeds: dict[str, np.ndarray] = {}
    inputs = []
    for c in consts.values():
        arr = u.const_array(c)
        if arr is None:
            raise ValueError(f"constant {c.name} is not readable")
        feeds[name_of(c)] = np.require(arr, requirements="C")
        inputs.append(
            onnx.helper.make_tensor_value_info(
                name_of(c), onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape)
            )
        )
    outputs = []
    seen_out: set[str] = set()
    for value, _, _ in plans:
        nm = name_of(value)
        if nm in seen_out:
            continue
        seen_out.add(nm)
        outputs.append(onnx.helper.make_tensor_value_info(nm, int(value.dtype), None))  # type: ignore[arg-type]
    opsets = [
        onnx.helper.make_opsetid(d if d != "ai.onnx" else "", v)
        for d, v in model.opset_imports.items()
    ]
    proto_model = onnx.helper.make_model(
        onnx.helper.make_graph(node_protos, "fold", inputs, outputs),
        opset_imports=opsets,
        ir_version=max(model.ir_version or 8, 4),
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(
        proto_model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    results = dict(zip([o.name for o in outputs], sess.run(None, feeds), strict=True))
    return [np.asarray(results[name_of(value)]) for value, _, _ in plans]
