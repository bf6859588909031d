"""No command destroys its input: an output whose model file or data file is, or aliases, any
file the input model reads (wherever in the model it is read) is refused, exit 2, and every
input file is byte-identical afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphtrim.cli import main


def _external(name: str, array: np.ndarray, folder: Path, location: str) -> onnx.TensorProto:
    """A tensor whose data lives in ``folder / location`` (appended, its offset recorded)."""
    data = folder / location
    offset = data.stat().st_size if data.exists() else 0
    with open(data, "ab") as fh:
        fh.write(array.tobytes())
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(array.shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", array.nbytes)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _model(folder: Path, where: str, location: str) -> Path:
    """``x + w`` with ``w`` (4096 floats) in external data ``location``, read from the main
    graph's initializers, from inside an ``If`` branch, or from a ``Constant`` node."""
    folder.mkdir(parents=True, exist_ok=True)
    w = np.arange(4096, dtype=np.float32).reshape(64, 64) / 100
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])
    inits: list[onnx.TensorProto] = []
    if where == "initializer":
        inits.append(_external("w", w, folder, location))
        nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    elif where == "constant":
        nodes = [
            helper.make_node("Constant", [], ["w"], value=_external("w", w, folder, location)),
            helper.make_node("Add", ["x", "w"], ["y"]),
        ]
    else:  # a subgraph's initializer
        branch = helper.make_graph(
            [helper.make_node("Add", ["x", "wb"], ["yb"])],
            "then",
            [],
            [helper.make_tensor_value_info("yb", TensorProto.FLOAT, [64, 64])],
            [_external("wb", w, folder, location)],
        )
        other = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["ye"])],
            "else",
            [],
            [helper.make_tensor_value_info("ye", TensorProto.FLOAT, [64, 64])],
        )
        inits.append(helper.make_tensor("c", TensorProto.BOOL, [], [True]))
        nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "a.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["optimize", "quantize"])
@pytest.mark.parametrize("where", ["initializer", "subgraph", "constant"])
def test_an_output_data_file_named_like_the_inputs_weights_is_refused(
    tmp_path: Path, command: str, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _model(tmp_path, where, "b.onnx.data")  # the input reads b.onnx.data
    before = _snapshot(tmp_path)
    args = [command, str(src), "-o", str(tmp_path / "b.onnx")]
    if command == "quantize":
        args += ["--variant", "int8-dynamic", "--no-tune"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would overwrite the input" in err[0] and "b.onnx.data" in err[0]
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("command", ["optimize", "quantize"])
def test_an_output_that_links_to_the_inputs_weights_is_refused(
    tmp_path: Path, link: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _model(tmp_path / "in", "initializer", "weights.bin")
    out = tmp_path / "out"
    out.mkdir()
    alias = out / "m.onnx.data"
    if link == "symlink":
        alias.symlink_to(tmp_path / "in" / "weights.bin")
    else:
        os.link(tmp_path / "in" / "weights.bin", alias)
    before = _snapshot(tmp_path / "in")
    args = [command, str(src), "-o", str(out / "m.onnx")]
    if command == "quantize":
        args += ["--variant", "int8-dynamic", "--no-tune"]
    assert main(args) == 2
    err = capsys.readouterr().err
    # a hard-linked data file: onnx's own loader refuses the input first
    assert "would overwrite the input" in err or (link == "hardlink" and "hard links" in err)
    assert _snapshot(tmp_path / "in") == before
    assert not (out / "m.onnx").exists()


def test_the_model_still_optimizes_to_a_free_name(tmp_path: Path) -> None:
    """The models above are valid: refused only for where they would be written."""
    for where in ("initializer", "subgraph", "constant"):
        src = _model(tmp_path / where, where, "b.onnx.data")
        assert main(["optimize", str(src), "-o", str(tmp_path / where / "c.onnx"), "--verify"]) == 0
