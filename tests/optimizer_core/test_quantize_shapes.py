"""onnxruntime's dynamic quantizer with graphtrim's weightless shape inference: the same output,
tensor for tensor, as the quantizer left as it is."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphtrim.quantize.shapes import infer_in_place, weightless_shape_inference

D = 32


def _model(path: Path) -> Path:
    """An embedding Gather, a Gemm with a transposed weight (which the quantizer turns into a
    MatMul before it infers shapes again), a Reshape by a constant shape, and an If whose
    branch multiplies by a weight of the outer graph; weights saved as external data."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    then = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w_branch"], ["y_then"])],
        "then",
        [],
        [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["y_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"]),
        helper.make_node("Gemm", ["e", "w_gemm", "b_gemm"], ["g"], transB=1),
        helper.make_node("Relu", ["g"], ["r"]),
        helper.make_node("MatMul", ["r", "w_mm"], ["m"]),
        helper.make_node("Reshape", ["m", "shape"], ["h"]),
        helper.make_node("If", ["flag"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            weight("embed", 64, D),
            weight("w_gemm", D, D),
            weight("b_gemm", D),
            weight("w_mm", D, D),
            weight("w_branch", D, D),
            numpy_helper.from_array(np.array([-1, D], dtype=np.int64), "shape"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=True, size_threshold=0)
    return path


def _quantized(src: Path, dst: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=None)
    return onnx.load(str(dst))


def test_the_quantizer_gives_the_same_model_with_weightless_shape_inference(
    tmp_path: Path,
) -> None:
    src = _model(tmp_path / "model.onnx")
    plain = _quantized(src, tmp_path / "plain.onnx")
    module = importlib.import_module("onnxruntime.quantization.onnx_quantizer")
    before = module.save_and_reload_model_with_shape_infer
    with weightless_shape_inference() as lent:
        assert lent and module.save_and_reload_model_with_shape_infer is infer_in_place
        lean = _quantized(src, tmp_path / "lean.onnx")
    assert module.save_and_reload_model_with_shape_infer is before
    # it quantized something: the Gemm became a MatMulInteger, the embedding int8
    assert "MatMulInteger" in {n.op_type for n in plain.graph.node}
    assert list(plain.graph.node) == list(lean.graph.node)
    assert list(plain.graph.value_info) == list(lean.graph.value_info)
    assert list(plain.graph.output) == list(lean.graph.output)
    arrays = {t.name: numpy_helper.to_array(t) for t in plain.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in lean.graph.initializer}
    assert arrays.keys() == got.keys()
    for name, value in arrays.items():
        assert value.dtype == got[name].dtype and np.array_equal(value, got[name]), name

    import onnxruntime as ort

    feeds = {"ids": np.array([1, 5, 63], dtype=np.int64), "flag": np.array(True)}
    outs = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        for p in (tmp_path / "plain.onnx", tmp_path / "lean.onnx")
    ]
    np.testing.assert_array_equal(outs[0], outs[1])


def test_inference_in_place_keeps_the_weights_and_reads_no_values(tmp_path: Path) -> None:
    """The inferred types land in the model passed in (no copy); its weights are untouched, and
    the copy shape inference sees has no float values to read."""
    model = onnx.load(str(_model(tmp_path / "model.onnx")))
    weights = {t.name: t.SerializeToString() for t in model.graph.initializer}
    out = infer_in_place(model)
    assert out is model
    assert {t.name: t.SerializeToString() for t in model.graph.initializer} == weights
    typed = {vi.name: vi for vi in model.graph.value_info}
    assert {"e", "g", "r", "m", "h"} <= typed.keys()
    assert [d.dim_value for d in typed["h"].type.tensor_type.shape.dim][1] == D
    assert any(p.key == "onnx.infer" for p in model.metadata_props)


def test_an_onnxruntime_without_the_helper_quantizes_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = importlib.import_module("onnxruntime.quantization.onnx_quantizer")
    monkeypatch.delattr(module, "save_and_reload_model_with_shape_infer")
    with weightless_shape_inference() as lent:
        assert not lent
        assert not hasattr(module, "save_and_reload_model_with_shape_infer")
