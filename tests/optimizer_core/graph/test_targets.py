"""Target profiles: portable, onnxruntime contrib fusions where they help, TensorRT-safe ops."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from graphtrim import ort_target as targets
from graphtrim.errors import GraphtrimError
from graphtrim.graph.framework import OptimizeOptions
from tests.helpers import assert_equivalent, op_types, run_passes
from tests.optimizer_core.graph.test_transformer import _gelu_tanh

RNG = np.random.default_rng(5)
F = onnx.TensorProto.FLOAT


def _conv_relu() -> onnx.ModelProto:
    w = numpy_helper.from_array(RNG.standard_normal((8, 3, 3, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(RNG.standard_normal(8).astype(np.float32), "B")
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", F, [1, 8, 16, 16])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _meta(proto: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def test_portable_records_target_and_fusions_in_the_model():
    out, result = run_passes(_gelu_tanh(20))
    assert op_types(out) == ["Gelu"]
    meta = _meta(out)
    assert meta["graphtrim.target"] == "portable"
    assert json.loads(meta["graphtrim.fusions"]) == {"gelu-tanh": 1}
    assert result.log.to_json()["target"] == {"target": "portable"}


def test_tensorrt_keeps_gelu_decomposed():
    proto = _gelu_tanh(20)
    out, _ = run_passes(proto, options=OptimizeOptions(target="tensorrt"))
    assert "Gelu" not in op_types(out) and "Tanh" in op_types(out)
    assert _meta(out)["graphtrim.target"] == "tensorrt"
    assert_equivalent(proto, out, rtol=1e-6, atol=1e-6)


def test_unknown_target_is_refused():
    with pytest.raises(GraphtrimError, match="unknown target"):
        OptimizeOptions(target="tpu")


def test_ort_cpu_applies_contrib_fusions_or_says_why_not():
    proto = _conv_relu()
    out, result = run_passes(proto, options=OptimizeOptions(target="ort-cpu"))
    record = result.log.target
    assert record["target"] == "ort-cpu"
    assert record["provider"] == "CPUExecutionProvider"
    assert record["contrib_ops"] == {"com.microsoft::FusedConv": 1}
    domains = {n.domain for n in out.graph.node}
    if record["kept"] == "fused":
        assert op_types(out) == ["FusedConv"] and domains == {"com.microsoft"}
    else:  # measured slower on this machine: the portable model stays, with the reason
        assert "ran at" in record["why"] and domains <= {"", "ai.onnx"}
    assert _meta(out)["graphtrim.target"] == "ort-cpu"
    assert_equivalent(proto, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fused_p50", "kept"), [(0.9, "fused"), (1.01, "fused"), (1.2, "portable")]
)
def test_ort_fused_model_is_kept_only_when_not_slower(monkeypatch, fused_p50, kept):
    # the decision, with the timing replaced (the real timing runs in the test above)
    monkeypatch.setattr(targets, "_p50s", lambda paths, *a: ([1.0, 0.5], [1.0, fused_p50]))
    out, result = run_passes(_conv_relu(), options=OptimizeOptions(target="ort-cpu"))
    assert result.log.target["kept"] == kept
    assert ("FusedConv" in op_types(out)) == (kept == "fused")


def test_ort_cuda_without_cuda_is_a_clear_error(monkeypatch):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("GRAPHTRIM_TEST_GPU_ON_CPU", raising=False)
    with pytest.raises(GraphtrimError, match="CUDAExecutionProvider"):
        run_passes(_conv_relu(), options=OptimizeOptions(target="ort-cuda"))


def test_cli_target_flag(tmp_path):
    from graphtrim.cli import main

    src = tmp_path / "m.onnx"
    onnx.save(_gelu_tanh(20), src)
    out = tmp_path / "o.onnx"
    report = tmp_path / "r.json"
    rc = main(
        [
            "optimize",
            str(src),
            "-o",
            str(out),
            "--target",
            "tensorrt",
            "--verify",
            "--report",
            str(report),
            "-q",
        ]
    )
    assert rc == 0
    data = json.loads(report.read_text())["optimization"]
    assert data["target"] == {"target": "tensorrt"}
    assert _meta(onnx.load(out))["graphtrim.target"] == "tensorrt"
