"""PyTorch-level simplification before export, and what it changes in the ONNX model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from graphtrim.exporter import _export_torch
from graphtrim.graph.optimizer import optimize_model
from graphtrim.stages.context import PipelineConfig
from graphtrim.torch_simplify import fx_simplify


class ConstantArithmetic(nn.Module):
    """The source document's example (constant tensors combined with the input in forward),
    plus arithmetic on parameters only (a weight scaled by a gain) and dead code."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 10))
        self.gain = nn.Parameter(torch.full((5, 1), 0.5))
        self.bias = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
        b = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
        unused = x * 3  # noqa: F841 - dead on purpose
        return nn.functional.linear(x + w, self.weight * self.gain, self.bias + b)


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # torch.fx cannot trace a branch on a tensor's value
            return x * 2
        return x


def _export(module: nn.Module, example: np.ndarray, path) -> onnx.ModelProto:
    exporter, _ = _export_torch(module, [example], [[0]], ["x"], path)
    assert exporter in ("dynamo", "torchscript")
    return onnx.load(str(path))


def _graphtrim_nodes(proto: onnx.ModelProto) -> int:
    return len(optimize_model(ir.serde.deserialize_model(proto)).model.graph)


def _run(path, example: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": example})[0]


@pytest.mark.parametrize(
    ("factory", "shape"), [(ConstantArithmetic, (2, 10)), (SmallCnn, (2, 1, 8, 8))]
)
def test_fx_simplify_keeps_results_and_what_it_changes_in_onnx(tmp_path, factory, shape):
    """Measured: the module's outputs are unchanged; the exported graph is never larger; after
    graphtrim the node counts are equal (the exporter and graphtrim fold the same constants)."""
    torch.manual_seed(0)
    module = factory().eval()
    simplified, notes = fx_simplify(module)
    assert notes and notes[0].startswith("fx simplification:")
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    with torch.no_grad():
        ref = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(
            simplified(torch.from_numpy(x)).numpy(), ref, rtol=1e-6, atol=1e-6
        )
    plain = _export(module, x, tmp_path / "plain.onnx")
    folded = _export(simplified, x, tmp_path / "folded.onnx")
    assert len(folded.graph.node) <= len(plain.graph.node)
    assert _graphtrim_nodes(folded) == _graphtrim_nodes(plain)
    np.testing.assert_allclose(_run(tmp_path / "folded.onnx", x), ref, rtol=1e-5, atol=1e-5)


def test_fx_simplify_folds_the_constant_arithmetic_and_drops_dead_code():
    simplified, notes = fx_simplify(ConstantArithmetic().eval())
    assert "1 dead node(s) removed" in notes[0]
    folded = int(notes[0].split(", ")[1].split()[0])
    assert folded == 2, notes  # weight * gain and bias + b read constants only
    import operator

    targets = [n.target for n in simplified.graph.nodes if n.op == "call_function"]
    assert operator.mul not in targets, simplified.graph  # weight * gain is a stored tensor now


def test_untraceable_module_is_exported_as_it_is(tmp_path):
    module = DataDependent().eval()
    same, notes = fx_simplify(module)
    assert same is module
    assert len(notes) == 1 and "cannot trace" in notes[0]
    x = np.ones((2, 3), np.float32)
    _export(same, x, tmp_path / "m.onnx")
    np.testing.assert_allclose(_run(tmp_path / "m.onnx", x), x * 2)


def test_fx_simplify_enters_the_config_hash_only_when_on():
    plain = PipelineConfig()
    doc = plain.to_json()
    for k in (
        "calibration",
        "eval_data",
        "experiment",
        "target_name",
        "fx_simplify",
        "weights",
        "tune",
        "opset",
    ):
        doc.pop(k)
    # the hash of a config without the options is what it was before they existed
    assert plain.config_hash == hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    assert PipelineConfig(fx_simplify=True).config_hash != plain.config_hash
    assert PipelineConfig.from_json(PipelineConfig(fx_simplify=True).to_json()).fx_simplify


def test_cli_pipeline_takes_fx_simplify():
    from graphtrim.cli import build_parser

    args = build_parser().parse_args(["pipeline", "run", "--model", "models:/m/1", "--fx-simplify"])
    assert args.fx_simplify is True
