"""Intermediate type and shape annotations (``value_info``) leave optimized models; graph
inputs and outputs, and values made by ops of unknown domains, keep theirs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest

from graphtrim.cli import main
from graphtrim.graph.metadata import strip_intermediate_shapes
from graphtrim.optimize_file import optimize_file

FLOAT = onnx.TensorProto.FLOAT


def _branch(name: str, op: str) -> onnx.GraphProto:
    return oh.make_graph(
        [
            oh.make_node(op, ["a"], [f"{name}_t"]),
            oh.make_node("Relu", [f"{name}_t"], [f"{name}_y"]),
        ],
        name,
        [],
        [oh.make_tensor_value_info(f"{name}_y", FLOAT, ["N", 3])],
        value_info=[oh.make_tensor_value_info(f"{name}_t", FLOAT, ["N", 3])],
    )


def model_with_annotations() -> onnx.ModelProto:
    """``x -> Relu -> Neg -> If(c) {Sin -> Relu | Cos -> Relu} -> Sigmoid``; every
    intermediate value annotated, the branches' own intermediates too."""
    nodes = [
        oh.make_node("Relu", ["x"], ["r"]),
        oh.make_node("Neg", ["r"], ["a"]),
        oh.make_node(
            "If",
            ["c"],
            ["b"],
            then_branch=_branch("then", "Sin"),
            else_branch=_branch("else", "Cos"),
        ),
        oh.make_node("Sigmoid", ["b"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [
            oh.make_tensor_value_info("x", FLOAT, ["N", 3]),
            oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        [oh.make_tensor_value_info("y", FLOAT, ["N", 3])],
        value_info=[oh.make_tensor_value_info(n, FLOAT, ["N", 3]) for n in ("r", "a", "b")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=9)


def _value_infos(proto: onnx.ModelProto) -> set[str]:
    names: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        names.update(vi.name for vi in g.value_info)
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)

    walk(proto.graph)
    return names


def test_optimized_output_keeps_only_graph_input_and_output_annotations(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model_with_annotations(), src)
    report = optimize_file(src, dst, check=True)
    out = onnx.load(dst)
    assert _value_infos(out) == set()
    output = out.graph.output[0].type.tensor_type
    assert output.elem_type == FLOAT
    assert [d.dim_param or d.dim_value for d in output.shape.dim] == ["N", 3]
    # the branches' outputs keep their types: If's inference reads them
    for node in out.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                assert attr.g.output[0].type.tensor_type.elem_type == FLOAT
    assert report.shapes_stripped == 5  # r, a, b and one per branch
    assert report.to_json()["intermediate_shapes"] == {"stripped": True, "values": 5}
    # onnx's inference recovers what went, and onnxruntime runs the result
    inferred = onnx.shape_inference.infer_shapes(out, strict_mode=True)
    assert {"r", "a", "b"} <= {vi.name for vi in inferred.graph.value_info}
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
        got = ort.InferenceSession(dst, providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_keep_shapes_keeps_them(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model_with_annotations(), src)
    report = optimize_file(src, dst, keep_shapes=True)
    assert {"r", "a", "b", "then_t", "else_t"} <= _value_infos(onnx.load(dst))
    assert report.shapes_stripped is None
    assert report.to_json()["intermediate_shapes"] == {"stripped": False}


def test_cli_keep_shapes_flag(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(model_with_annotations(), src)
    assert main(["optimize", str(src), "-o", str(tmp_path / "a.onnx"), "-q"]) == 0
    assert _value_infos(onnx.load(tmp_path / "a.onnx")) == set()
    report = tmp_path / "r.json"
    argv = ["optimize", str(src), "-o", str(tmp_path / "b.onnx"), "-q", "--keep-shapes"]
    assert main([*argv, "--report", str(report)]) == 0
    assert "r" in _value_infos(onnx.load(tmp_path / "b.onnx"))
    assert json.loads(report.read_text())["intermediate_shapes"] == {"stripped": False}


def test_values_of_unknown_domains_keep_their_annotations() -> None:
    """onnx's inference cannot type an op it has no schema for (onnxruntime's contrib ops
    included); what follows such an op would lose its type for good."""
    nodes = [
        oh.make_node("Relu", ["x"], ["r"]),
        oh.make_node("FusedGemm", ["r", "w"], ["g"], domain="com.microsoft"),
        oh.make_node("Custom", ["g"], ["u"], domain="com.example"),
        oh.make_node("Neg", ["u"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", FLOAT, [2, 3])],
        initializer=[onnx.numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")],
        value_info=[oh.make_tensor_value_info(n, FLOAT, [2, 3]) for n in ("r", "g", "u")],
    )
    proto = oh.make_model(
        graph,
        opset_imports=[
            oh.make_opsetid("", 17),
            oh.make_opsetid("com.microsoft", 1),
            oh.make_opsetid("com.example", 1),
        ],
    )
    model = ir.serde.deserialize_model(proto)
    assert strip_intermediate_shapes(model) == 2  # r, and the initializer w
    saved = ir.serde.serialize_model(model)
    assert {vi.name for vi in saved.graph.value_info} == {"g", "u"}
    assert onnx.numpy_helper.to_array(saved.graph.initializer[0]).shape == (3, 3)
    assert saved.graph.output[0].type.tensor_type.elem_type == FLOAT
    # a second call finds nothing left to strip
    assert strip_intermediate_shapes(model) == 0


@pytest.mark.parametrize("keep", [False, True])
def test_function_bodies_follow_the_same_rule(keep: bool) -> None:
    body = [oh.make_node("Relu", ["a"], ["t"]), oh.make_node("Neg", ["t"], ["b"])]
    fn = oh.make_function("local", "F", ["a"], ["b"], body, [oh.make_opsetid("", 17)])
    graph = oh.make_graph(
        [oh.make_node("F", ["x"], ["y"], domain="local")],
        "g",
        [oh.make_tensor_value_info("x", FLOAT, [2])],
        [oh.make_tensor_value_info("y", FLOAT, [2])],
    )
    proto = oh.make_model(
        graph,
        opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)],
        functions=[fn],
    )
    model = ir.serde.deserialize_model(proto)
    function = next(iter(model.functions.values()))
    t = next(iter(function)).outputs[0]
    t.type = ir.TensorType(ir.DataType.FLOAT)
    t.shape = ir.Shape([2])
    if not keep:
        assert strip_intermediate_shapes(model) == 1
        assert t.type is None and t.shape is None
    # the function's output and the graph's output are untouched
    assert model.graph.outputs[0].type is not None
