"""Exporter debug metadata (node metadata_props, doc strings) leaves optimized models; the
model's own metadata_props and everything that computes stay."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest

from graphtrim.cli import main
from graphtrim.graph.metadata import strip_debug_metadata, strip_debug_metadata_stats
from graphtrim.optimize_file import optimize_file

FLOAT = onnx.TensorProto.FLOAT


def _graphs(proto: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    def walk(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from walk(sub)

    yield from walk(proto.graph)


def debug_items(proto: onnx.ModelProto) -> dict[str, int]:
    """Debug metadata counted on the protobuf, independently of the stripping code."""
    counts = {"node_props": 0, "node_docs": 0, "value_docs": 0, "graph_docs": 0, "pkg_props": 0}
    nodes: list[onnx.NodeProto] = []
    for g in _graphs(proto):
        nodes += g.node
        counts["graph_docs"] += bool(g.doc_string)
        values = [*g.input, *g.output, *g.value_info]
        counts["value_docs"] += sum(bool(v.doc_string) for v in values)
        counts["pkg_props"] += sum(
            p.key.startswith("pkg.") for v in [g, *values] for p in v.metadata_props
        )
    for f in proto.functions:
        nodes += f.node
        counts["graph_docs"] += bool(f.doc_string)
        counts["pkg_props"] += sum(p.key.startswith("pkg.") for p in f.metadata_props)
    counts["node_props"] = sum(len(n.metadata_props) for n in nodes)
    counts["node_docs"] = sum(bool(n.doc_string) for n in nodes)
    return counts


class ConvBnLinear:
    """A tiny keyword-spotting-like model: Conv1d + BatchNorm + Linear."""

    @staticmethod
    def module() -> Any:
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv = nn.Conv1d(4, 8, 3)
                self.bn = nn.BatchNorm1d(8)
                self.fc = nn.Linear(8 * 6, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))

        torch.manual_seed(0)
        net = Net().eval()
        mean, var = net.bn.running_mean, net.bn.running_var
        assert mean is not None and var is not None
        with torch.no_grad():  # non-trivial statistics: folding BatchNorm changes the weights
            mean.uniform_(-0.5, 0.5)
            var.uniform_(0.5, 2.0)
        return net


def _export(path: Path, *, dynamo: bool) -> Path:
    import torch

    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(
                ConvBnLinear.module(),
                (x,),
                str(path),
                dynamo=True,
                external_data=False,
                dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},),
                input_names=["x"],
                output_names=["y"],
                verbose=False,
            )
        else:
            # verbose: the TorchScript exporter writes each node's stack trace as its doc_string
            torch.onnx.export(
                ConvBnLinear.module(),
                (x,),
                str(path),
                dynamo=False,
                verbose=True,
                do_constant_folding=False,
                input_names=["x"],
                output_names=["y"],
                dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            )
    return path


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"export-{request.param}")
    return _export(folder / "net.onnx", dynamo=request.param == "dynamo")


def test_torch_export_metadata_is_stripped_by_default(exported: Path, tmp_path: Path) -> None:
    before = debug_items(onnx.load(str(exported)))
    assert before["node_props"] + before["node_docs"] > 0, before
    out = tmp_path / "out.onnx"
    report = optimize_file(exported, out, check=True)
    after = debug_items(onnx.load(str(out)))
    assert after == dict.fromkeys(after, 0)
    # verification compared the stripped output with the (annotated) input
    assert report.verification is not None and report.verification.ok
    stripped = report.to_json()["debug_metadata"]
    assert stripped["stripped"] is True and stripped["items"] > 0
    # the same optimization with the metadata kept is larger by at least the bytes reported
    kept = tmp_path / "kept.onnx"
    optimize_file(exported, kept, keep_metadata=True)
    assert kept.stat().st_size - out.stat().st_size >= stripped["bytes"] > 0


def test_strip_count_matches_what_the_file_held(exported: Path) -> None:
    proto = onnx.load(str(exported))
    expected = debug_items(proto)
    model = ir.serde.deserialize_model(proto)
    stats = strip_debug_metadata_stats(model)
    assert stats.items == sum(expected.values())
    saved = ir.serde.serialize_model(model)
    assert debug_items(saved) == dict.fromkeys(expected, 0)
    # the byte count is what the removed fields took in the serialized model
    unstripped = ir.serde.serialize_model(ir.serde.deserialize_model(proto))
    assert 0 < stats.bytes <= unstripped.ByteSize() - saved.ByteSize()
    assert strip_debug_metadata(model) == 0


def test_keep_metadata_keeps_it(exported: Path, tmp_path: Path) -> None:
    before = debug_items(onnx.load(str(exported)))
    out = tmp_path / "out.onnx"
    report = optimize_file(exported, out, keep_metadata=True)
    after = debug_items(onnx.load(str(out)))
    # nodes the passes removed take their metadata with them; the survivors keep theirs
    assert after["node_props"] + after["node_docs"] > 0
    assert after["node_props"] <= before["node_props"]
    assert report.to_json()["debug_metadata"] == {"stripped": False}


def test_cli_keep_metadata_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _export(tmp_path / "net.onnx", dynamo=True)
    kept, stripped = tmp_path / "kept.onnx", tmp_path / "stripped.onnx"
    assert main(["optimize", str(src), "-o", str(kept), "--keep-metadata", "-q"]) == 0
    report = tmp_path / "r.json"
    assert main(["optimize", str(src), "-o", str(stripped), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "debug metadata: removed" in out
    assert debug_items(onnx.load(str(kept)))["node_props"] > 0
    assert debug_items(onnx.load(str(stripped)))["node_props"] == 0
    doc = json.loads(report.read_text())
    assert doc["debug_metadata"]["stripped"] is True and doc["debug_metadata"]["items"] > 0
    assert stripped.stat().st_size < kept.stat().st_size


def _annotate(node: onnx.NodeProto, text: str) -> onnx.NodeProto:
    node.doc_string = f"stack trace of {text}"
    oh.set_metadata_props(node, {"pkg.torch.onnx.stack_trace": text, "namespace": text})
    return node


def _model_with_if() -> onnx.ModelProto:
    """y = If(c, then: Relu(x), else: Neg(x)) * w; debug metadata everywhere, including in
    both branches, and model-level metadata of the user and of graphtrim."""
    then_g = oh.make_graph(
        [_annotate(oh.make_node("Relu", ["x"], ["t"]), "then")],
        "then",
        [],
        [oh.make_tensor_value_info("t", FLOAT, [2, 3])],
    )
    then_g.doc_string = "then branch"
    else_g = oh.make_graph(
        [_annotate(oh.make_node("Neg", ["x"], ["e"]), "else")],
        "else",
        [],
        [oh.make_tensor_value_info("e", FLOAT, [2, 3])],
    )
    x = oh.make_tensor_value_info("x", FLOAT, [2, 3])
    x.doc_string = "the input"
    oh.set_metadata_props(x, {"pkg.torch.onnx.original_node_name": "x", "unit": "volts"})
    w = onh.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    graph = oh.make_graph(
        [
            _annotate(
                oh.make_node("If", ["c"], ["b"], then_branch=then_g, else_branch=else_g), "if"
            ),
            _annotate(oh.make_node("Mul", ["b", "w"], ["y"]), "mul"),
        ],
        "main",
        [x, oh.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", FLOAT, [2, 3])],
        [w],
    )
    graph.doc_string = "main graph"
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    model.doc_string = "the model's own description"
    oh.set_model_props(model, {"author": "someone", "graphtrim.target": "portable"})
    return model


def test_subgraph_doc_strings_go_model_metadata_stays(tmp_path: Path) -> None:
    src = tmp_path / "if.onnx"
    onnx.save(_model_with_if(), str(src))
    assert debug_items(onnx.load(str(src)))["node_docs"] == 4
    out = tmp_path / "out.onnx"
    report = optimize_file(src, out, check=True)
    assert report.verification is not None and report.verification.ok
    result = onnx.load(str(out))
    assert debug_items(result) == dict.fromkeys(debug_items(result), 0)
    ifs = [n for n in result.graph.node if n.op_type == "If"]
    assert len(ifs) == 1  # the branches survived, so the check above looked inside them
    branches = [a.g for a in ifs[0].attribute]
    assert sorted(n.op_type for g in branches for n in g.node) == ["Neg", "Relu"]
    assert all(not n.doc_string and not n.metadata_props for g in branches for n in g.node)
    props = {p.key: p.value for p in result.metadata_props}
    assert props["author"] == "someone" and props["graphtrim.target"] == "portable"
    assert result.doc_string == "the model's own description"
    # a value's own (non-package) metadata stays, the exporter's goes
    (x,) = [v for v in result.graph.input if v.name == "x"]
    assert {p.key: p.value for p in x.metadata_props} == {"unit": "volts"}


def test_strip_leaves_computation_alone() -> None:
    """Attributes, names, types and functions' contents stay; functions' debug metadata goes."""
    proto = _model_with_if()
    fn_node = _annotate(oh.make_node("Transpose", ["a"], ["b"], perm=[1, 0]), "fn")
    fn = oh.make_function(
        "local", "T", ["a"], ["b"], [fn_node], [oh.make_opsetid("", 17)], doc_string="a function"
    )
    proto.functions.append(fn)
    proto.opset_import.append(oh.make_opsetid("local", 1))
    proto.graph.node.append(oh.make_node("T", ["y"], ["z"], domain="local"))
    proto.graph.output.append(oh.make_tensor_value_info("z", FLOAT, [3, 2]))
    model = ir.serde.deserialize_model(proto)
    assert strip_debug_metadata(model) == sum(debug_items(proto).values())
    saved = ir.serde.serialize_model(model)
    assert debug_items(saved) == dict.fromkeys(debug_items(saved), 0)
    assert not saved.functions[0].doc_string and not saved.functions[0].node[0].metadata_props

    def bare(m: onnx.ModelProto) -> onnx.ModelProto:
        """``m`` with all debug metadata cleared directly on the protobuf."""
        m = onnx.ModelProto.FromString(m.SerializeToString())
        for g in _graphs(m):
            g.doc_string = ""
            del g.metadata_props[:]
            for n in g.node:
                n.doc_string = ""
                del n.metadata_props[:]
            for v in [*g.input, *g.output, *g.value_info]:
                v.doc_string = ""
                keep = [(p.key, p.value) for p in v.metadata_props if not p.key.startswith("pkg.")]
                del v.metadata_props[:]
                oh.set_metadata_props(v, dict(keep))
        for f in m.functions:
            f.doc_string = ""
            for n in f.node:
                n.doc_string = ""
                del n.metadata_props[:]
        return m

    expected = ir.serde.serialize_model(ir.serde.deserialize_model(bare(proto)))
    assert saved.SerializeToString() == expected.SerializeToString()
